"""The program representation: what a program and a sharding are.

Holds the JAX compatibility module (every private JAX name), the sharding type, the flat program view of a
jaxpr (with the control-flow forms' bodies as sub-programs), factors (the vocabulary rules are written in)
and sub-axes. Imports nothing else of the partitioner."""
