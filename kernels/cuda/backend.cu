// The CUDA backend's memory ops, stream, scratch area and factory. Buffers come from cudaMalloc
// while the run is planned (the trainer allocates arenas up front; nothing is allocated in the
// step loop), every copy and fill is enqueued on the compute stream, and copy_to_host waits for
// the stream so the host sees every earlier op's result.
//
// copy_from_host does not wait for the stream: the host bytes are copied into one of a few
// pinned staging buffers (kStagingSlots of kStagingSlotBytes, allocated at the first upload) and
// the device copy is enqueued from there, so the caller may reuse its buffer at once and the GPU
// keeps running. Each buffer carries an event recorded after its device copy; a buffer is
// refilled only after its event (the copy kStagingSlots uploads back), so the host waits at
// most for that copy, never for the compute work queued before it. A large upload goes through
// the buffers in turn, the host filling one while the DMA drains another. (A cudaMemcpyAsync
// straight from pageable memory may synchronise with the stream to stage it: the drain this
// avoids.)
#include <algorithm>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/scratch.cuh"

namespace tetra {

void CudaScratchDeleter::operator()(CudaScratch* s) const {
  if (s->data) cudaFree(s->data);
  delete s;
}

constexpr int kStagingSlots = 4;
constexpr size_t kStagingSlotBytes = size_t{4} << 20;

struct CudaStaging {
  void* host[kStagingSlots] = {};
  cudaEvent_t copied[kStagingSlots] = {};  // recorded after the device copy out of host[i]
  int next = 0;
};

void CudaStagingDeleter::operator()(CudaStaging* s) const {
  for (int i = 0; i < kStagingSlots; ++i) {
    if (s->copied[i]) {
      cudaEventSynchronize(s->copied[i]);
      cudaEventDestroy(s->copied[i]);
    }
    if (s->host[i]) cudaFreeHost(s->host[i]);
  }
  delete s;
}

namespace {
// Sizes of live allocations, for the allocated/peak figures (free() gets only the pointer).
std::mutex g_sizes_mutex;
std::unordered_map<void*, size_t> g_sizes;
}  // namespace

CudaBackend::CudaBackend(int device, AttentionPath attention) : device_(device), attention_path_(attention) {
  int count = 0;
  TETRA_CUDA_CHECK(cudaGetDeviceCount(&count));
  TETRA_CHECK(device >= 0 && device < count, "CUDA device {} requested, {} present", device, count);
  TETRA_CUDA_CHECK(cudaSetDevice(device));
  cudaStream_t s = nullptr;
  TETRA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
}

std::string CudaBackend::kernel_report() const {
  std::string out;
  for (const std::string& part : {attention_report(), gemm_report()})
    if (!part.empty()) out += (out.empty() ? "" : "; ") + part;
  return out;
}

CudaBackend::~CudaBackend() {
  // Kernel-file state first (it may hold device memory and handles bound to the stream).
  if (stream_) cudaStreamSynchronize(cuda::as_stream(stream_));
  gemm_.reset();
  attention_.reset();
  scratch_.reset();
  staging_.reset();
  if (stream_) cudaStreamDestroy(cuda::as_stream(stream_));
}

CudaScratch& CudaBackend::scratch() {
  if (!scratch_) {
    auto s = std::unique_ptr<CudaScratch, CudaScratchDeleter>(new CudaScratch);
    s->floats = size_t{1} << 20;  // 4 MiB: partials of any reduction the kernels launch
    TETRA_CUDA_CHECK(cudaMalloc(&s->data, s->floats * sizeof(float)));
    scratch_ = std::move(s);
  }
  return *scratch_;
}

void* CudaBackend::alloc(size_t bytes) {
  void* ptr = nullptr;
  const cudaError_t err = cudaMalloc(&ptr, bytes == 0 ? 256 : bytes);
  if (err != cudaSuccess) {
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    throw Error(fmt::format("cuda alloc of {} bytes failed ({}): {} of {} bytes free on device {}, "
                            "{} allocated by this run",
                            bytes, cudaGetErrorString(err), free_b, total_b, device_, allocated_));
  }
  {
    std::lock_guard<std::mutex> lock(g_sizes_mutex);
    g_sizes[ptr] = bytes;
  }
  allocated_ += bytes;
  if (allocated_ > peak_allocated_) peak_allocated_ = allocated_;
  return ptr;
}

void CudaBackend::free(void* ptr) {
  if (!ptr) return;
  {
    std::lock_guard<std::mutex> lock(g_sizes_mutex);
    auto it = g_sizes.find(ptr);
    if (it != g_sizes.end()) {
      allocated_ -= it->second;
      g_sizes.erase(it);
    }
  }
  // cudaFree synchronises the device: buffers are freed when the run ends, never in the step loop.
  TETRA_CUDA_CHECK(cudaFree(ptr));
}

void CudaBackend::memset_zero(void* ptr, size_t bytes) {
  if (bytes == 0) return;
  TETRA_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, cuda::as_stream(stream_)));
}

void CudaBackend::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  TETRA_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, cuda::as_stream(stream_)));
  TETRA_CUDA_CHECK(cudaStreamSynchronize(cuda::as_stream(stream_)));
}

void CudaBackend::copy_from_host(void* dst, const void* host_src, size_t bytes) {
  if (bytes == 0) return;
  if (!staging_) {
    std::unique_ptr<CudaStaging, CudaStagingDeleter> s(new CudaStaging);
    for (int i = 0; i < kStagingSlots; ++i) {
      TETRA_CUDA_CHECK(cudaMallocHost(&s->host[i], kStagingSlotBytes));
      TETRA_CUDA_CHECK(cudaEventCreateWithFlags(&s->copied[i], cudaEventDisableTiming));
    }
    staging_ = std::move(s);
  }
  // The host buffer may be reused as soon as this returns: its bytes are in a staging buffer.
  const cudaStream_t stream = cuda::as_stream(stream_);
  auto* d = static_cast<char*>(dst);
  const auto* h = static_cast<const char*>(host_src);
  for (size_t done = 0; done < bytes;) {
    const size_t n = std::min(kStagingSlotBytes, bytes - done);
    const int slot = staging_->next;
    staging_->next = (slot + 1) % kStagingSlots;
    TETRA_CUDA_CHECK(cudaEventSynchronize(staging_->copied[slot]));  // its previous copy is done
    std::memcpy(staging_->host[slot], h + done, n);
    TETRA_CUDA_CHECK(cudaMemcpyAsync(d + done, staging_->host[slot], n, cudaMemcpyHostToDevice, stream));
    TETRA_CUDA_CHECK(cudaEventRecord(staging_->copied[slot], stream));
    done += n;
  }
}

void CudaBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  TETRA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda::as_stream(stream_)));
}

void CudaBackend::copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                          size_t rows) {
  if (width == 0 || rows == 0) return;
  TETRA_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDeviceToDevice,
                                     cuda::as_stream(stream_)));
}

void CudaBackend::synchronize() { TETRA_CUDA_CHECK(cudaStreamSynchronize(cuda::as_stream(stream_))); }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

std::unique_ptr<Backend> make_cuda_backend(int device, AttentionPath attention) {
  return std::make_unique<CudaBackend>(device, attention);
}

}  // namespace tetra
