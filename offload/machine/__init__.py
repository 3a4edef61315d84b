"""What the machine gives the runtime: the compute device's streams and events (or their CPU emulation),
pinned and aligned host buffers, the host allocator's threshold, the CPUs a process may use, the compiled kernels,
and local ranks for tests and benchmarks."""
