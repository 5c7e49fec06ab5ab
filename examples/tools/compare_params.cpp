// compare_params.cpp: compares two parameter files written by the trainers' --params-out
// (raw fp32 values) and fails when they differ by more than a tolerance.
//
//   compare_params REFERENCE CANDIDATE [MAX_ABS_DIFF]     (default 0: bit-for-bit equal)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "cli.hpp"

namespace {

bool read_floats(const char* path, std::vector<float>& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  const std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.size() % sizeof(float) != 0) return false;
  out.resize(bytes.size() / sizeof(float));
  if (!bytes.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Compares two parameter files written by the trainers' --params-out (raw fp32 "
               "values); fails when they differ by more than the tolerance."};
  shardopt::cli::init(app, "compare_params");
  std::string reference, candidate;
  double tol = 0.0;
  app.add_option("REFERENCE", reference, "the reference file")->required();
  app.add_option("CANDIDATE", candidate, "the file to compare with it")->required();
  app.add_option("MAX_ABS_DIFF", tol, "largest |difference| allowed; 0: bit-for-bit equal")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  if (const int rc = shardopt::cli::parse(app, argc, argv); rc >= 0) return rc;
  std::vector<float> ref, got;
  for (auto [path, v] : {std::pair{&reference, &ref}, std::pair{&candidate, &got}}) {
    if (!read_floats(path->c_str(), *v)) {
      std::fprintf(stderr, "cannot read %s as raw fp32 values\n", path->c_str());
      return 1;
    }
  }
  if (ref.size() != got.size() || ref.empty()) {
    std::fprintf(stderr, "%s has %zu values, %s has %zu\n", reference.c_str(), ref.size(),
                 candidate.c_str(), got.size());
    return 1;
  }
  std::size_t bit_differences = 0;
  double worst = 0;
  for (std::size_t k = 0; k < ref.size(); ++k) {
    if (std::memcmp(&ref[k], &got[k], sizeof(float)) != 0) ++bit_differences;
    const double d = std::fabs(static_cast<double>(ref[k]) - got[k]);
    worst = std::isnan(d) ? INFINITY : std::max(worst, d);
  }
  std::printf("%zu values: %zu differ in their bits, max |difference| %.3e (tolerance %.1e)\n",
              ref.size(), bit_differences, worst, tol);
  const bool ok = tol == 0.0 ? bit_differences == 0 : worst <= tol;
  return ok ? 0 : 1;
}
