"""torch.compile backend: FX split pass at the layer ops, rewrite passes, piecewise and full
CUDA-graph runners. (Filled by the compile issue.)
"""
