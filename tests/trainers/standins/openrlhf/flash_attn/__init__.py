"""Stand-in for flash-attn (a CUDA-only build): openrlhf.models.ring_attn_utils imports it at module level;
only ring attention (GPU training) calls it, never the reward path. Import-only: every name raises if called."""
