#include "grads.h"

#include <c10/core/DispatchKey.h>
#include <c10/core/TensorImpl.h>

#include <utility>

namespace memprof {

GradWatch::GradWatch(std::vector<at::Tensor> params) : params_(std::move(params)), seen_(params_.size()) {}

namespace {
bool plain_storage(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return !impl->is_python_dispatch() && !impl->key_set().has(c10::DispatchKey::Functionalize) &&
         impl->has_storage() && (t.is_cpu() || t.is_cuda());
}
}  // namespace

std::vector<GradBlock> GradWatch::changed() {
  std::vector<GradBlock> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad = params_[i].grad();
    std::optional<Seen>& seen = seen_[i];
    if (!grad.defined()) {
      seen.reset();
      continue;
    }
    const auto index = static_cast<int64_t>(i);
    if (!plain_storage(grad)) {
      seen.reset();
      out.push_back(GradBlock{index, -1, 0, -1, -1});
      continue;
    }
    c10::TensorImpl* impl = grad.unsafeGetTensorImpl();
    const c10::Storage& storage = impl->storage();
    const void* ptr = storage.data();
    const size_t bytes = storage.nbytes();
    if (seen && !seen->impl.expired() && seen->impl._unsafe_get_target() == impl && seen->ptr == ptr &&
        seen->bytes == bytes) {
      continue;
    }
    seen = Seen{c10::weak_intrusive_ptr<c10::TensorImpl>(grad.getIntrusivePtr()), ptr, bytes};
    if (ptr == nullptr || bytes == 0) continue;
    const c10::Device device = grad.device();
    out.push_back(GradBlock{index, static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptr)),
                            static_cast<int64_t>(bytes), static_cast<int8_t>(device.type()),
                            static_cast<int8_t>(device.has_index() ? device.index() : -1)});
  }
  return out;
}

}  // namespace memprof
