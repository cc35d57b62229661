// The hit path of a program cache (issue 16): the same 3-node eager expression on 1,024 CPU
// elements, timed with its one program cached and again with 1,000 programs cached beside it in the
// same cache (other shapes, filed by their exact shapes) and 1,000 in the process's eager budget.
// Prints the time a call of each and their ratio; the target is within 1.2x.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include <kiln/kiln.hpp>

namespace k = kiln;

namespace {

// Medians over 9 alternating rounds of the time a call of a and of b, in microseconds: machine
// noise then moves both alike.
template <class A, class B>
std::pair<double, double> time_pair(A&& a, B&& b, int calls = 20000) {
  std::vector<double> ta, tb;
  auto once = [&](auto& f, std::vector<double>& out) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) f();
    auto t1 = std::chrono::steady_clock::now();
    out.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
  };
  for (int r = 0; r < 9; ++r) once(a, ta), once(b, tb);
  std::sort(ta.begin(), ta.end());
  std::sort(tb.begin(), tb.end());
  return {ta[ta.size() / 2], tb[tb.size() / 2]};
}

// Fills a cache with n copies of `like` filed under other exact shapes (its program is never run for
// them: only the lookup is measured).
void fill(k::runtime::ProgramCache& cache, const k::runtime::Entry& like, int n) {
  for (int i = 0; i < n; ++i) {
    auto e = std::make_shared<k::runtime::Entry>();
    e->guards = like.guards;
    for (auto& a : e->guards.args)
      if (a.rank > 0) a.shape[0] = 100000 + i;
    e->program = like.program;
    e->stats = like.stats;
    cache.adopt(std::move(e));
  }
}

}  // namespace

// The measured cache (b) against a control of the same shape (a) before and after b's cache gets
// 999 more programs: the ratio of b/a after to b/a before.
template <class A, class B, class Fill>
void compare(const char* what, A&& a, B&& b, Fill&& fill_b) {
  a(), b();
  auto [a0, b0] = time_pair(a, b);
  std::size_t n = fill_b();
  auto [a1, b1] = time_pair(a, b);
  std::printf("%s: %.3f us a call with 1 program cached, %.3f us with %zu (control %.3f -> %.3f us): ratio %.3f\n",
              what, b0, b1, n, a0, a1, (b1 / a1) / (b0 / a0));
}

int main() {
  k::Tensor x = k::randn({1024}, k::f32, k::cpu, 1);
  k::runtime::set_eager_capacity(4096);
  // Two 3-node expressions of distinct types (float and int scalars): one program cache each.
  compare(
      "eager x * 2 + 1 on 1,024 f32 (CPU)", [&] { k::Tensor y = x * 2.0f + 1.0f; }, [&] { k::Tensor y = x * 2 + 1; },
      [&] {
        auto& cache = k::detail::eager_cache<decltype(x * 2 + 1)>();
        fill(cache, *cache.entries().front(), 999);
        return cache.size();
      });
  auto fa = k::compile([](auto a) { return a * 2.0f + 1.0f; }, {.shapes = k::shapes::static_});
  auto fb = k::compile([](auto a) { return a * 2.0f + 1.0f; }, {.shapes = k::shapes::static_});
  compare(
      "compiled, static shapes           ", [&] { fa(x); }, [&] { fb(x); },
      [&] {
        fill(fb.cache(), *fb.cache().entries().front(), 999);
        return fb.cache().size();
      });
  return 0;
}
