"""Layer ops: the graph split points (attention core, GDN mixer core, Mamba2 mixer core, short conv
(LFM2; Mamba1's conv), Mamba1 scan core,
MiniMax lightning attention core).

They take activations plus the layer index, read pools and per-step metadata from the
forward context and dispatch to the kernel ops of :mod:`hybrid_compile.ops` by forward mode.
Their fake impls return zero-filled outputs of the right shape, so Dynamo traces a whole model
in one graph and the compile backend (:mod:`hybrid_compile.compilation`) cuts it at these ops.
"""
