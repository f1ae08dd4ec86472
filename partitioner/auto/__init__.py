"""The automatic sharding: a sharding for every value nobody annotated, from the partitioner's own costs.

Holds graph.py (the options per op and the edges between them), memory.py (the memory rows), solve.py (the
integer program), search.py (neighbourhood search on large graphs) and choice.py (the choice as seeds for
the one engine, and what explain() says about it). May import every phase below it; nothing imports it but
the API."""
