"""Independent plain-torch references: the literal per-token recurrence of every recurrent op.

Written as simply as possible, one token and one request at a time, sharing no code with
the op implementations. The ops (chunked forms, fused forms, later Triton kernels) are
tested against these, never the other way round.
"""
