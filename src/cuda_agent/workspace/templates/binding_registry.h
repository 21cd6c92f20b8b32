// Locked infrastructure: do not edit. Kernel binding files register their Python
// functions here with REGISTER_BINDING(name, fn); binding.cpp applies them all to the
// single module `cuda_extension`. Only pybind11 is included, so this stays cheap to compile.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

class BindingRegistry {
 public:
  using Binder = std::function<void(pybind11::module&)>;

  static BindingRegistry& getInstance() {
    static BindingRegistry registry;
    return registry;
  }

  void registerBinding(const std::string& name, Binder binder) {
    entries_.emplace_back(name, std::move(binder));
  }

  void applyBindings(pybind11::module& m) {
    for (auto& entry : entries_) entry.second(m);
  }

 private:
  BindingRegistry() = default;
  std::vector<std::pair<std::string, Binder>> entries_;
};

struct BindingRegistrar {
  BindingRegistrar(const std::string& name, BindingRegistry::Binder binder) {
    BindingRegistry::getInstance().registerBinding(name, std::move(binder));
  }
};

#define REGISTER_BINDING(name, fn)                                        \
  static BindingRegistrar _cuda_agent_registrar_##name(#name,             \
      [](pybind11::module& m) { fn(m); })
