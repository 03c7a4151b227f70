// Sets the conditional handles of a CUDA graph's IF nodes from a device predicate array; launched as a
// kernel node of the same graph, right before the IF nodes (runtime/decode/conditional.py).
// handles [n] cudaGraphConditionalHandle (unsigned long long), hot [n] bool: handle i gets hot[i].
// Declared here rather than through cuda_device_runtime_api.h so that NVRTC, which lacks that header,
// compiles the same source; the name is resolved by ptxas as the device runtime's builtin.
extern "C" __device__ void cudaGraphSetConditional(unsigned long long handle, unsigned int value);

extern "C" __global__ void kdtree_set_conditionals(const unsigned long long* handles, const bool* hot, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) cudaGraphSetConditional(handles[i], hot[i] ? 1u : 0u);
}

// Sets the conditional handle of a CUDA graph's SWITCH node from the same one-hot array: the index of the hot
// entry (body i runs), or n when none is hot (a value >= the node's size runs no body).  One thread.
extern "C" __global__ void kdtree_set_switch(unsigned long long handle, const bool* hot, int n) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  unsigned int value = (unsigned int)n;
  for (int i = 0; i < n; ++i)
    if (hot[i]) value = (unsigned int)i;
  cudaGraphSetConditional(handle, value);
}
