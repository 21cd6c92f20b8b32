// Locked infrastructure: do not edit. Every REGISTER_BINDING in kernels/ lands in this
// one module, imported from model_new.py as `cuda_extension`.
#include <pybind11/pybind11.h>

#include "binding_registry.h"

PYBIND11_MODULE(cuda_extension, m) {
  BindingRegistry::getInstance().applyBindings(m);
}
