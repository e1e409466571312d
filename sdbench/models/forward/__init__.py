"""sdbench's forward: the native runner and the generic one, the forward paths (eager, CPU-packed, compiled, CUDA
graphs) with the CPU products' C sources, the rotary embedding, Phi-3's recomputation and sliding windows."""
