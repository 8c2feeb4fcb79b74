// Runs an AOTInductor package (.pt2) whose graph calls lowbit's operators,
// from a C++ program with no Python in the process:
//
//   lowbit_aoti_runner OPS_LIBRARY PACKAGE INPUTS OUTPUTS
//
// OPS_LIBRARY is liblowbit_ops.so. It must be loaded before the package runs:
// AOTInductor calls operators it has no C shim for (all of lowbit's) through
// the dispatcher by name, and the library's static initializers are what
// register torch.ops.lowbit. INPUTS is a list of tensors written by Python's
// torch.save; they are moved to the package's device. OUTPUTS receives the
// outputs, on the CPU, as a tuple that torch.load reads.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "cannot open ", path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary);
  TORCH_CHECK(out, "cannot write ", path);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(out, "writing ", path, " failed");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: " << argv[0] << " OPS_LIBRARY PACKAGE INPUTS OUTPUTS\n";
    return 2;
  }
  try {
    if (dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      std::cerr << "cannot load the op library " << argv[1] << ": " << dlerror() << "\n";
      return 1;
    }
    torch::inductor::AOTIModelPackageLoader loader(argv[2]);
    const auto metadata = loader.get_metadata();
    const auto device_entry = metadata.find("AOTI_DEVICE_KEY");
    const c10::Device device(device_entry == metadata.end() ? std::string("cpu") : device_entry->second);

    std::vector<at::Tensor> inputs;
    const c10::IValue saved = torch::jit::pickle_load(read_file(argv[3]));
    TORCH_CHECK(saved.isList(), argv[3], ": expected a list of tensors (torch.save([x, ...], path))");
    for (const auto& value : saved.toListRef()) {
      inputs.push_back(value.toTensor().to(device));
    }
    std::vector<c10::IValue> outputs;
    for (const auto& out : loader.run(inputs)) {
      outputs.emplace_back(out.cpu());
    }
    write_file(argv[4], torch::jit::pickle_save(c10::ivalue::Tuple::create(std::move(outputs))));
  } catch (const std::exception& e) {
    std::cerr << "lowbit_aoti_runner: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
