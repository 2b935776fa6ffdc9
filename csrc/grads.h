// The gradients of a set of parameters, read at each optimizer step without Python: which are tensors
// not seen at the last read, and their storage. Torch's C++ API; no Python headers here.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace memprof {

// A gradient the watch has not seen: its parameter's index and its storage. `ptr` is -1 for a gradient
// this reader does not vouch for (a tensor subclass, a fake or functional tensor, a device other than
// the CPU and CUDA, no storage): the caller reads that one itself.
struct GradBlock {
  int64_t index;
  int64_t ptr;
  int64_t bytes;
  int8_t device_type;   // c10::DeviceType value
  int8_t device_index;  // -1 for the CPU
};

class GradWatch {
 public:
  explicit GradWatch(std::vector<at::Tensor> params);
  // The gradients that are other tensors than at the last call, or whose storage moved; none for a
  // parameter without one, nor for a gradient with no bytes.
  std::vector<GradBlock> changed();

 private:
  struct Seen {
    // (weak: a gradient set to None is freed as it would be; its TensorImpl's few hundred bytes wait for
    // the next read)
    c10::weak_intrusive_ptr<c10::TensorImpl> impl;
    const void* ptr;
    size_t bytes;
  };
  std::vector<at::Tensor> params_;
  std::vector<std::optional<Seen>> seen_;
};

}  // namespace memprof
