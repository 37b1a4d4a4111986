// CUDA element-wise ops (add, GELU, SwiGLU; kernels/cuda/elementwise.cu) against the CPU ops, in
// fp32, bf16 and fp16, over sizes that exercise the vector path (16-byte chunks), the scalar head and
// tail around it, and the scalar fallback (pointers with different misalignments, widths that
// are not multiples of the vector width), plus the aliasing the contract allows.
//
// Tolerances:
// - add: exact. Both backends round the same fp32 sum a + b once (to bf16 / fp16 for those types).
// - GELU, SwiGLU in fp32: both evaluate the shared functions of kernels/common/math.h in fp32 in
//   the same expression order; only the compilers' contraction of a*b+c into fused multiply-adds
//   differs, a few ulp of each intermediate: rtol 1e-5. Near GELU's zeros (x << 0) the result is
//   0.5 x (1 + tanh u) with 1 + tanh u cancelling, where those ulp are ulp of 1 times |x| <= 4
//   (~5e-7): atol 2e-6.
// - bf16 / fp16 outputs: the two fp32 values (within the fp32 tolerance) may round to neighbouring
//   16-bit values: 1 ulp, which is at most 2^-7 (bf16) or 2^-10 (fp16) of the value (ulp 2^(e-7) or
//   2^(e-10) for |v| in [2^e, 2^(e+1))); fp16 values below its normal range have an ulp of 2^-24,
//   under the atol.
#include <array>
#include <cstdint>
#include <vector>

#include "tests/cuda/cuda_testing.h"

namespace tetra::cuda_testing {
namespace {

struct Tol {
  double rtol, atol;
};
Tol math_tol(DType t) { return Tol{storage_ulp(t) + 1e-5, 2e-6}; }

// Element `offset` of a twin's buffer on either backend.
void* at(void* base, int64_t offset, DType t) {
  return static_cast<uint8_t*>(base) + offset * static_cast<int64_t>(dtype_size(t));
}

const char* name(DType t) { return type_name(t); }

}  // namespace

TEST_CASE("cuda add matches the cpu exactly, in place and at any alignment",
          "[cuda][elementwise]") {
  Backend& cpu = *backends().cpu;
  Backend& gpu = *backends().gpu;
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    for (int64_t n : {1, 7, 33, 1000, 4099}) {
      // Offsets (out, a, b) in elements: all aligned, all equally misaligned (scalar head, then
      // vectors), differently misaligned (scalar path).
      for (auto [oo, oa, ob] : {std::array<int64_t, 3>{0, 0, 0}, {3, 3, 3}, {0, 1, 2}}) {
        DYNAMIC_SECTION(name(t) << " n=" << n << " offsets " << oo << "," << oa << "," << ob) {
          const size_t total = static_cast<size_t>(n + 4);
          Twin a(random_values(total, 1 + n), t), b(random_values(total, 2 + n), t);
          Twin out(random_values(total, 3 + n), t);
          cpu.add(at(out.cpu(), oo, t), at(a.cpu(), oa, t), at(b.cpu(), ob, t), n, t);
          gpu.add(at(out.gpu(), oo, t), at(a.gpu(), oa, t), at(b.gpu(), ob, t), n, t);
          require_close(out.cpu_values(), out.gpu_values(), 0.0, 0.0, "add out");
          // In place: a += b.
          cpu.add(at(a.cpu(), oa, t), at(a.cpu(), oa, t), at(b.cpu(), ob, t), n, t);
          gpu.add(at(a.gpu(), oa, t), at(a.gpu(), oa, t), at(b.gpu(), ob, t), n, t);
          require_close(a.cpu_values(), a.gpu_values(), 0.0, 0.0, "add in place");
        }
      }
    }
  }
}

TEST_CASE("cuda gelu forward and backward match the cpu, dx aliasing dy", "[cuda][elementwise]") {
  Backend& cpu = *backends().cpu;
  Backend& gpu = *backends().gpu;
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    const Tol tol = math_tol(t);
    for (int64_t n : {1, 7, 33, 1000, 4099}) {
      for (int64_t offset : {0, 1}) {
        DYNAMIC_SECTION(name(t) << " n=" << n << " offset " << offset) {
          const size_t total = static_cast<size_t>(n + 1);
          Twin x(random_values(total, 10 + n, 4.0f), t), dy(random_values(total, 11 + n), t);
          Twin y(total, t), dx(random_values(total, 12 + n), t);
          cpu.gelu_forward(at(y.cpu(), offset, t), at(x.cpu(), offset, t), n, t);
          gpu.gelu_forward(at(y.gpu(), offset, t), at(x.gpu(), offset, t), n, t);
          require_close(y.cpu_values(), y.gpu_values(), tol.rtol, tol.atol, "gelu y");

          cpu.gelu_backward(at(dx.cpu(), offset, t), at(x.cpu(), offset, t),
                            at(dy.cpu(), offset, t), n, t);
          gpu.gelu_backward(at(dx.gpu(), offset, t), at(x.gpu(), offset, t),
                            at(dy.gpu(), offset, t), n, t);
          require_close(dx.cpu_values(), dx.gpu_values(), tol.rtol, tol.atol, "gelu dx");

          // dx aliasing dy (the gradient overwritten in place).
          cpu.gelu_backward(at(dy.cpu(), offset, t), at(x.cpu(), offset, t),
                            at(dy.cpu(), offset, t), n, t);
          gpu.gelu_backward(at(dy.gpu(), offset, t), at(x.gpu(), offset, t),
                            at(dy.gpu(), offset, t), n, t);
          require_close(dy.cpu_values(), dy.gpu_values(), tol.rtol, tol.atol, "gelu dx in place");
          // The in-place result is the out-of-place one (same inputs, same kernel), over the
          // op's range (the element outside it keeps each buffer's own initial value).
          auto range = [&](const std::vector<float>& v) {
            return std::vector<float>(v.begin() + offset, v.begin() + offset + n);
          };
          require_close(range(dx.gpu_values()), range(dy.gpu_values()), 0.0, 0.0,
                        "gelu in place vs not");
        }
      }
    }
  }
}

TEST_CASE("cuda swiglu forward and backward match the cpu", "[cuda][elementwise]") {
  Backend& cpu = *backends().cpu;
  Backend& gpu = *backends().gpu;
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    const Tol tol = math_tol(t);
    for (int64_t N : {1, 7, 33}) {
      // F = 8, 64: vector path for both types; 1, 5, 771: scalar.
      for (int64_t F : {1, 5, 8, 64, 771}) {
        DYNAMIC_SECTION(name(t) << " N=" << N << " F=" << F) {
          const size_t nx = static_cast<size_t>(N * 2 * F), ny = static_cast<size_t>(N * F);
          Twin x(random_values(nx, 20 + N * F, 4.0f), t), dy(random_values(ny, 21 + N * F), t);
          Twin y(random_values(ny, 22), t), dx(random_values(nx, 23), t);
          cpu.swiglu_forward(y.cpu(), x.cpu(), N, F, t);
          gpu.swiglu_forward(y.gpu(), x.gpu(), N, F, t);
          require_close(y.cpu_values(), y.gpu_values(), tol.rtol, tol.atol, "swiglu y");
          cpu.swiglu_backward(dx.cpu(), x.cpu(), dy.cpu(), N, F, t);
          gpu.swiglu_backward(dx.gpu(), x.gpu(), dy.gpu(), N, F, t);
          require_close(dx.cpu_values(), dx.gpu_values(), tol.rtol, tol.atol, "swiglu dx");
        }
      }
    }
  }
}

TEST_CASE("cuda swiglu with misaligned rows takes the scalar path and still matches",
          "[cuda][elementwise]") {
  Backend& cpu = *backends().cpu;
  Backend& gpu = *backends().gpu;
  for (DType t : {DType::BF16, DType::F16}) {
    const int64_t N = 7, F = 64;  // vectorisable width, but the pointers start 1 element in
    const size_t nx = static_cast<size_t>(N * 2 * F + 1), ny = static_cast<size_t>(N * F + 1);
    Twin x(random_values(nx, 30, 4.0f), t), dy(random_values(ny, 31), t);
    Twin y(ny, t), dx(nx, t);
    cpu.swiglu_forward(at(y.cpu(), 1, t), at(x.cpu(), 1, t), N, F, t);
    gpu.swiglu_forward(at(y.gpu(), 1, t), at(x.gpu(), 1, t), N, F, t);
    const Tol tol = math_tol(t);
    require_close(y.cpu_values(), y.gpu_values(), tol.rtol, tol.atol, "swiglu y");
    cpu.swiglu_backward(at(dx.cpu(), 1, t), at(x.cpu(), 1, t), at(dy.cpu(), 1, t), N, F, t);
    gpu.swiglu_backward(at(dx.gpu(), 1, t), at(x.gpu(), 1, t), at(dy.gpu(), 1, t), N, F, t);
    require_close(dx.cpu_values(), dx.gpu_values(), tol.rtol, tol.atol, "swiglu dx");
  }
}

}  // namespace tetra::cuda_testing
