"""Attention kernels: a C++ one for CPU (built on first use) and Triton ones for CUDA."""
