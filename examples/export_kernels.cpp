// Exported kernels (ahead of time, like AOTInductor): kiln writes the fused kernels of a function
// with a launcher and a header, and a codebase builds them with plain nvcc — no kiln, no NVRTC at
// run time. This exports residual + rms_norm with dynamic sizes from CPU tensors (no GPU needed)
// and writes inputs with kiln's own result beside it, which examples/export/check.cu compares
// against the exported kernels on a GPU (examples/export/run.sh does every step).
#include <fstream>
#include <iostream>

#include <kiln/kiln.hpp>

namespace k = kiln;

namespace {

void write_f32(const std::filesystem::path& path, const k::Tensor& t) {
  auto v = k::to_vector<float>(t);
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
}

}  // namespace

int main(int argc, char** argv) {
  std::filesystem::path dir = argc > 1 ? argv[1] : "exported";
  auto norm = k::compile([](auto x, auto residual, auto w) { return k::rms_norm(x + residual, w); },
                         {.shapes = k::shapes::dynamic});

  // Shapes and dtypes are all export needs: sizes become symbols s0, s1 checked by the launcher.
  auto x = k::randn({8, 1024}, k::f32, k::cpu, 1), r = k::randn({8, 1024}, k::f32, k::cpu, 2),
       w = k::randn({1024}, k::f32, k::cpu, 3);
  k::exported_kernels e = k::export_kernels(norm, x, r, w, dir, k::export_options{.name = "residual_rms_norm"});
  std::cout << "exported " << e.kernels.size() << " kernel(s) for " << e.arch << ":\n";
  for (const auto& f : e.files()) std::cout << "  " << f.string() << "\n";

  // A check for the exported code at another size than the exported one: inputs and kiln's result.
  std::filesystem::path check = dir / "check";
  std::filesystem::create_directories(check);
  auto cx = k::randn({37, 4096}, k::f32, k::cpu, 4), cr = k::randn({37, 4096}, k::f32, k::cpu, 5),
       cw = k::randn({4096}, k::f32, k::cpu, 6);
  write_f32(check / "x.f32", cx);
  write_f32(check / "residual.f32", cr);
  write_f32(check / "w.f32", cw);
  write_f32(check / "expected.f32", norm(cx, cr, cw));
  std::ofstream(check / "shape.txt") << "37 4096\n";
  std::cout << "  " << check.string() << "/ (inputs and kiln's result at [37, 4096])\n";
  return 0;
}
