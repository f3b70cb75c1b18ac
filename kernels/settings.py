"""Launch-policy and memory-policy constants, in one place. Each says where it came from.

NORM_CHUNK_BYTES: budget for the fp32 W chunk (and its square) of the torch factored norm.
  Chosen to keep the fallback's extra memory far below a dense d_out × d_in temporary while
  keeping each chunk GEMM large (at d_out = 8192 a 32 MiB budget gives 512-column chunks).
"""

NORM_CHUNK_BYTES = 32 * 1024 * 1024
