"""Flax models laid out by logical axis rules (logical.py): GShard's MoE layer (moe.py, gating.py; dropless
dispatch in dropless.py and grouped.py), the Transformer LMs and encoder-decoder built from it (layers.py,
transformer.py), their pipelined stacks (pipelined.py), ring attention (ring_attention.py) and CNNs (cnn.py);
lm.py is a small functional LM the partitioner's tests train."""
