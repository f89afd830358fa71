"""Units of memory, one definition for every module: binary, as torch, NVML and the hw presets count them
(hw.memory_gib=40 is 40 x 2^30 bytes; serve.max_body_mib, MiB)."""

KIB = 2**10
MIB = 2**20
GIB = 2**30
