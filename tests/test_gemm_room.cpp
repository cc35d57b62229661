// schedule/pad_buffers.hpp: in a CUDA plan, intermediates that 16-bit GEMMs read or write over a
// size off 8 (GPT-2's vocabulary) are stored with room, so that the GEMM runs its padded problem in
// place instead of on padded copies. The host cases read the plan (no GPU needed); the GPU cases
// check values against the CPU program and against the copies (KILN_TUNE_GEMM_ROOM=0), plainly and
// replayed from a CUDA graph.
#include <doctest/doctest.h>

#include <cstdint>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "cuda_plan.hpp"
#include "have_gpu.hpp"
#include "scoped_env.hpp"

namespace k = kiln;
namespace rt = kiln::runtime;
namespace sch = kiln::schedule;

namespace {

// GPT-2's head: bf16 hidden rows times the tied bf16 embedding, transposed, into a cross_entropy.
auto lm_head_loss = [](auto h, auto wte, auto t) {
  auto logits = k::matmul(k::cast(h, k::bf16), k::transpose(k::cast(wte, k::bf16), 0, 1));
  return k::cross_entropy(k::cast(logits, k::f32), t);
};

k::Tensor targets(std::int64_t n, std::int64_t classes, std::uint64_t seed) {
  std::vector<std::int64_t> t;
  for (std::int64_t i = 0; i < n; ++i)
    t.push_back(static_cast<std::int64_t>((static_cast<std::uint64_t>(i) * 2654435761u + seed) % classes));
  return k::from_vector(t, {n});
}

// The nodes of a plan stored with room, as "op [shape] -> [storage]".
std::vector<std::string> roomy(const rt::Program& p) {
  std::vector<std::string> out;
  for (int i = 0; i < p.graph.size(); ++i)
    if (auto pad = sch::padding_of(p.sched, i))
      out.push_back(std::string(k::name(p.graph[i].op)) + " " + p.graph[i].shape.str() + " -> " +
                    sch::padded_shape(p.graph[i].shape, pad).str());
  return out;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + "; ";
  return s;
}

}  // namespace

TEST_CASE("gemm room: an lm_head's training step stores its vocabulary-wide buffers with room (CUDA plan)") {
  const std::int64_t n = 96, d = 64, V = 1001;
  auto h = k::randn({n, d}, k::f32, k::cpu, 1), wte = k::randn({V, d}, k::f32, k::cpu, 2);
  auto t = targets(n, V, 3);
  auto step = k::compile(k::value_and_grad(lm_head_loss, k::wrt<0, 1>));
  auto p = plan_for(k::Device(k::cuda), step, h, wte, t);
  const auto r = roomy(*p);
  INFO("with room: " << joined(r));
  // The bf16 embedding gets rows (n of the forward, k of dh), the logits and their gradient
  // columns (n of the forward; k of dh, m of dwte). The f32 dwte is returned: no room.
  CHECK(r == std::vector<std::string>{"cast [1001, 64] -> [1008, 64]", "matmul [96, 1001] -> [96, 1008]",
                                      "add [96, 1001] -> [96, 1008]"});
  // Generated kernels address the logits and their gradient by rows of 1008.
  int strided = 0;
  for (const auto& kern : p->kernels)
    if (kern.extern_node < 0 && kern.src.source.find("1008") != std::string::npos) ++strided;
  CHECK(strided >= 1);
  // The plan's kernels compile for the GPU (NVRTC, no device needed).
  CHECK_FALSE(
      rt::compile_cubin(rt::cuda_translation_unit(*p, rt::program_body(*p)), "kiln_room_test", "sm_90a").empty());

  // Not on the CPU, not with the knob off, not for aligned sizes, not for f32 products.
  CHECK(roomy(*plan_for(k::cpu, step, h, wte, t)).empty());
  {
    ScopedEnv off("KILN_TUNE_GEMM_ROOM", "0");
    CHECK(roomy(*plan_for(k::Device(k::cuda), step, h, wte, t)).empty());
  }
  auto aligned_wte = k::randn({1008, d}, k::f32, k::cpu, 4);
  CHECK(roomy(*plan_for(k::Device(k::cuda), step, h, aligned_wte, targets(n, 1008, 5))).empty());
  auto f32_loss = [](auto h, auto wte, auto t) { return k::cross_entropy(k::matmul(h, k::transpose(wte, 0, 1)), t); };
  CHECK(roomy(*plan_for(k::Device(k::cuda), k::compile(k::value_and_grad(f32_loss, k::wrt<0, 1>)), h, wte, t)).empty());
}

TEST_CASE("gemm room: returned products, thin products and products read through a reshape keep their shape") {
  const std::int64_t d = 64, V = 1001;
  auto wte = k::randn({V, d}, k::f32, k::cpu, 6);
  auto bf = [](auto x) { return k::cast(x, k::bf16); };
  // A returned product is the caller's tensor: no room, whatever its sizes (the cast it reads has).
  auto h = k::randn({96, d}, k::f32, k::cpu, 7);
  auto returned = k::compile([bf](auto h, auto w) { return k::matmul(bf(h), k::transpose(bf(w), 0, 1)); });
  CHECK(roomy(*plan_for(k::Device(k::cuda), returned, h, wte)) ==
        std::vector<std::string>{"cast [1001, 64] -> [1008, 64]"});
  // A matrix-vector product waits on memory: its vector gets no room.
  auto v = k::randn({1, d}, k::f32, k::cpu, 8);
  auto thin =
      k::compile([bf](auto v, auto w) { return k::sum(k::cast(k::matmul(bf(v), k::transpose(bf(w), 0, 1)), k::f32)); });
  CHECK(roomy(*plan_for(k::Device(k::cuda), thin, v, wte)).empty());
  // A [2, 48, 1001] product whose rows a GEMM reads through a reshape: the reshape is no view of
  // a strided buffer, so the product keeps its shape.
  auto h3 = k::randn({2, 48, d}, k::f32, k::cpu, 9), w2 = k::randn({V, 24}, k::f32, k::cpu, 10);
  auto chained = k::compile([bf](auto h, auto w, auto w2) {
    auto logits = k::matmul(bf(h), k::transpose(bf(w), 0, 1));  // [2, 48, 1001]
    return k::sum(k::cast(k::matmul(k::reshape(logits, {96, 1001}), bf(w2)), k::f32));
  });
  for (const auto& s : roomy(*plan_for(k::Device(k::cuda), chained, h3, wte, w2)))
    CHECK(s.find("[96, 1001]") == std::string::npos);
}

// A custom op writes its whole contiguous output itself: a GEMM reading it over k = 1001 pads a
// copy, the output gets no room (the review's finding: a user's function would have written rows
// of 1001 into rows of 1008, and the GEMM read its room as zeros).
k::CustomOp doubled = k::custom_op("doubled", {.forward = [](std::span<const k::Tensor> in, k::Tensor& out, k::Stream) {
                                     k::eval(out, in[0] * 2.0f);
                                   }});

TEST_CASE("gemm room: a buffer an extern step other than a plain GEMM writes keeps its shape") {
  auto x = k::randn({96, 1001}, k::f32, k::cpu, 20), w = k::randn({1001, 64}, k::f32, k::cpu, 21);
  auto f = k::compile([](auto x, auto w) {
    return k::sum(k::cast(k::matmul(doubled(k::cast(x, k::bf16)), k::cast(w, k::bf16)), k::f32));
  });
  const auto r = roomy(*plan_for(k::Device(k::cuda), f, x, w));
  INFO("with room: " << joined(r));
  CHECK(r == std::vector<std::string>{"cast [1001, 64] -> [1008, 64]"});  // w's cast has room, the op's output none
}

TEST_CASE("gemm room: plan_padding reads and writes in place what has room") {
  auto view = [](const k::Dims& shape, const k::Dims& strides, k::dtype dt) {
    return k::Tensor::empty({1}, dt, k::cpu).as_strided(shape, strides, 0);
  };
  // logits [8192, 50257] (row stride 50264) = h [8192, 768] @ wte^T, wte [50257, 768] with 7 rows of room.
  k::Tensor h = view({8192, 768}, {768, 1}, k::bf16), wt = view({768, 50257}, {1, 768}, k::bf16),
            logits = view({8192, 50257}, {50264, 1}, k::bf16);
  rt::GemmPlan p = rt::plan_gemm(rt::matmul_geometry(h, wt, logits, "matmul"), true, true, true);
  const rt::GemmRooms rooms{{}, {768, 50264}, {8192, 50264}};
  rt::GemmPadding pad = rt::plan_padding(p, 2, 2, rt::cuda_mm_detail::gemm_room(p, &rooms, h, wt, h, wt));
  CHECK(pad.pad);
  CHECK((pad.a && pad.in_a && pad.d && pad.in_d && !pad.b));
  CHECK((pad.m == 50264 && pad.rows_a == 768 && pad.cols_a == 50264));
  // Without the output's room: the wte side in place, the output through a padded copy.
  const rt::GemmRooms no_out{{}, {768, 50264}, {}};
  pad = rt::plan_padding(p, 2, 2, rt::cuda_mm_detail::gemm_room(p, &no_out, h, wt, h, wt));
  CHECK((pad.pad && pad.in_a && pad.d && !pad.in_d));
  // Room smaller than the padded size is no room.
  const rt::GemmRooms short_room{{}, {768, 50260}, {8192, 50264}};
  pad = rt::plan_padding(p, 2, 2, rt::cuda_mm_detail::gemm_room(p, &short_room, h, wt, h, wt));
  CHECK((pad.a && !pad.in_a && pad.in_d));
  // A thin product stays as it is, room or not.
  k::Tensor v = view({1, 768}, {768, 1}, k::bf16), row = view({1, 50257}, {50264, 1}, k::bf16);
  rt::GemmPlan thin = rt::plan_gemm(rt::matmul_geometry(v, wt, row, "matmul"), true, true, true);
  const rt::GemmRooms thin_rooms{{}, {768, 50264}, {1, 50264}};
  CHECK_FALSE(rt::plan_padding(thin, 2, 2, rt::cuda_mm_detail::gemm_room(thin, &thin_rooms, v, wt, v, wt)).pad);
}

TEST_CASE("cuda: an lm_head's training step with room: values as on the CPU and as with padded copies" * needs_gpu()) {
  const std::int64_t n = 300, d = 136;
  for (std::int64_t V : {1001, 50257}) {
    CAPTURE(V);
    auto h = k::randn({n, d}, k::f32, k::cpu, 11), wte = k::randn({V, d}, k::f32, k::cpu, 12);
    auto t = targets(n, V, 13);
    auto hg = h.to(k::cuda), wg = wte.to(k::cuda), tg = t.to(k::cuda);
    auto room = k::compile(k::value_and_grad(lm_head_loss, k::wrt<0, 1>));
    auto graphed = k::compile(k::value_and_grad(lm_head_loss, k::wrt<0, 1>), {.cuda_graphs = true});
    auto [l, dh, dw] = room(hg, wg, tg);
    auto p = room.cache().entries().at(0);
    std::tuple<k::Tensor, k::Tensor, k::Tensor> copies;
    {
      ScopedEnv off("KILN_TUNE_GEMM_ROOM", "0");
      copies = k::compile(k::value_and_grad(lm_head_loss, k::wrt<0, 1>))(hg, wg, tg);
    }
    auto [lc, dhc, dwc] =
        k::compile(k::value_and_grad(lm_head_loss, k::wrt<0, 1>))(h, wte, t);  // CPU, f32 math on bf16 values
    for (int i = 0; i < 3; ++i) {                                              // replays, the last one checked
      auto [lg, dhg, dwg] = graphed(hg, wg, tg);
      if (i < 2) continue;
      CHECK(k::to_vector<float>(lg) == k::to_vector<float>(l));
      CHECK(k::to_vector<float>(dhg) == k::to_vector<float>(dh));
      CHECK(k::to_vector<float>(dwg) == k::to_vector<float>(dw));
    }
    auto near = [](const k::Tensor& got, const k::Tensor& want) {
      double big = 0;
      for (float x : k::to_vector<float>(want)) big = std::max(big, static_cast<double>(std::abs(x)));
      auto r = k::testing::allclose(got, want, 2e-2, 2e-2 * big);
      CHECK_MESSAGE(bool(r), r);
    };
    near(l, std::get<0>(copies)), near(dh, std::get<1>(copies)), near(dw, std::get<2>(copies));
    near(l, lc), near(dh, dhc), near(dw, dwc);
    // The logits' kernel writes no copies: the program's GEMMs read and write the buffers in place.
    bool any_room = false;
    for (int i = 0; i < p->program->graph.size(); ++i)
      any_room = any_room || bool(sch::padding_of(p->program->sched, i));
    CHECK(any_room);
  }
}
