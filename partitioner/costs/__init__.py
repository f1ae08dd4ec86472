"""The machine and the costs every decision is priced with.

Holds the hardware model, the collectives' alpha-beta costs, the overlap of communication with compute,
and memory: which values are alive at once (lifetimes.py), where XLA's buffers are not the program's values
(fusion.py, buffer_reuse.py, and identities.py where the plan's shardings are known) and the temporaries'
peak (liveness.py, with XLA:CPU's own buffers). May import representation/ and rules/."""
