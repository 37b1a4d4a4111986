// The one reader of the environment (trainer/core/runtime_options.h): defaults with nothing set,
// each variable into its field, an empty variable as an unset one, and a value a variable cannot
// take refused with an InputError naming the variable.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "kernels/common/check.h"
#include "trainer/core/runtime_options.h"

using namespace tetra;
using Catch::Matchers::Contains;

namespace {

const char* const kVariables[] = {
    "TETRA_ATTENTION",      "TETRA_NCCL_BLOCKING_WAIT", "TETRA_RENDEZVOUS",       "TETRA_TEST_GUARDED_MEMORY",
    "TETRA_TEST_FAULT",     "TETRA_TEST_FAULT_STEPS",   "TETRA_TEST_FAULT_RANK",  "TETRA_TEST_HANG_RANK",
    "TETRA_TEST_HANG_STEP", "TETRA_TEST_HANG_SECONDS",  "TETRA_FAULT_SAVE_AT",    "TETRA_FAULT_SAVE_LOG",
    "TETRA_FAULT_NO_EXCHANGE"};

using Vars = std::vector<std::pair<const char*, const char*>>;

// Sets the variables for the lifetime of the object (every TETRA_* one the reader knows unset
// first), restoring what the process had afterwards.
class Environment {
 public:
  explicit Environment(const Vars& set) {
    for (const char* name : kVariables) {
      const char* v = std::getenv(name);
      saved_.emplace_back(name, v ? std::optional<std::string>(v) : std::nullopt);
      unsetenv(name);
    }
    for (const auto& [name, value] : set) setenv(name, value, 1);
  }
  ~Environment() {
    for (const auto& [name, value] : saved_) {
      if (value) setenv(name, value->c_str(), 1);
      else unsetenv(name);
    }
  }
  Environment(const Environment&) = delete;
  Environment& operator=(const Environment&) = delete;

 private:
  std::vector<std::pair<const char*, std::optional<std::string>>> saved_;
};

}  // namespace

TEST_CASE("runtime options: the defaults with nothing set", "[runtime_options]") {
  const Environment env(Vars{});
  const RuntimeOptions o = read_runtime_options();
  CHECK(o.attention == "auto");
  CHECK_FALSE(o.nccl_blocking_wait);
  CHECK(o.rendezvous_dir.empty());
  CHECK_FALSE(o.guarded_memory);
  CHECK(o.step_fault.kind.empty());
  CHECK(o.step_fault.steps.empty());
  CHECK(o.hang.rank == -1);
  CHECK(o.hang.step == -1);
  CHECK(o.hang.seconds == 3600);
  CHECK(o.save_faults.kill_at_call == 0);
  CHECK(o.save_faults.call_log.empty());
  CHECK_FALSE(o.save_faults.no_exchange);
}

TEST_CASE("runtime options: each variable into its field", "[runtime_options]") {
  const Environment env(Vars{{"TETRA_ATTENTION", "cudnn"},
                             {"TETRA_NCCL_BLOCKING_WAIT", "1"},
                             {"TETRA_RENDEZVOUS", "/shared/rdv"},
                             {"TETRA_TEST_GUARDED_MEMORY", "1"},
                             {"TETRA_TEST_FAULT", "nan-grad"},
                             {"TETRA_TEST_FAULT_STEPS", "4,,6"},
                             {"TETRA_TEST_FAULT_RANK", "3"},
                             {"TETRA_TEST_HANG_RANK", "2"},
                             {"TETRA_TEST_HANG_STEP", "5"},
                             {"TETRA_TEST_HANG_SECONDS", "7"},
                             {"TETRA_FAULT_SAVE_AT", "12"},
                             {"TETRA_FAULT_SAVE_LOG", "/tmp/calls.log"},
                             {"TETRA_FAULT_NO_EXCHANGE", "1"}});
  const RuntimeOptions o = read_runtime_options();
  CHECK(o.attention == "cudnn");
  CHECK(o.nccl_blocking_wait);
  CHECK(o.rendezvous_dir == "/shared/rdv");
  CHECK(o.guarded_memory);
  CHECK(o.step_fault.kind == "nan-grad");
  CHECK(o.step_fault.steps == std::vector<int64_t>{4, 6});
  CHECK(o.step_fault.rank == 3);
  CHECK(o.hang.rank == 2);
  CHECK(o.hang.step == 5);
  CHECK(o.hang.seconds == 7);
  CHECK(o.save_faults.kill_at_call == 12);
  CHECK(o.save_faults.call_log == "/tmp/calls.log");
  CHECK(o.save_faults.no_exchange);
}

TEST_CASE("runtime options: empty is unset, and 0 is off", "[runtime_options]") {
  const Environment env(Vars{{"TETRA_ATTENTION", ""},
                             {"TETRA_NCCL_BLOCKING_WAIT", "0"},
                             {"TETRA_TEST_GUARDED_MEMORY", "0"},
                             {"TETRA_TEST_FAULT", ""},
                             {"TETRA_FAULT_NO_EXCHANGE", "0"},
                             {"TETRA_TEST_HANG_SECONDS", ""}});
  const RuntimeOptions o = read_runtime_options();
  CHECK(o.attention == "auto");
  CHECK_FALSE(o.nccl_blocking_wait);
  CHECK_FALSE(o.guarded_memory);
  CHECK(o.step_fault.kind.empty());
  CHECK_FALSE(o.save_faults.no_exchange);
  CHECK(o.hang.seconds == 3600);
}

TEST_CASE("runtime options: a switch, number or fault the variable cannot take is refused, naming it",
          "[runtime_options]") {
  const std::vector<std::pair<Vars, std::string>> cases = {
      {{{"TETRA_NCCL_BLOCKING_WAIT", "true"}}, "TETRA_NCCL_BLOCKING_WAIT=true is not a switch value"},
      {{{"TETRA_TEST_GUARDED_MEMORY", "yes"}}, "TETRA_TEST_GUARDED_MEMORY=yes is not a switch value"},
      {{{"TETRA_FAULT_NO_EXCHANGE", "2"}}, "TETRA_FAULT_NO_EXCHANGE=2 is not a switch value"},
      {{{"TETRA_TEST_HANG_SECONDS", "10s"}}, "TETRA_TEST_HANG_SECONDS=10s is not a whole number"},
      {{{"TETRA_FAULT_SAVE_AT", "x"}}, "TETRA_FAULT_SAVE_AT=x is not a whole number"},
      {{{"TETRA_TEST_FAULT", "nan-loss"}}, "TETRA_TEST_FAULT and TETRA_TEST_FAULT_STEPS go together"},
      {{{"TETRA_TEST_FAULT", "bogus"}, {"TETRA_TEST_FAULT_STEPS", "1"}}, "TETRA_TEST_FAULT=bogus is not one of"},
      {{{"TETRA_TEST_FAULT", "nan-loss"}, {"TETRA_TEST_FAULT_STEPS", "2,x"}}, "\"x\" is not a step"},
      {{{"TETRA_TEST_FAULT", "nan-loss"}, {"TETRA_TEST_FAULT_STEPS", ","}}, "TETRA_TEST_FAULT_STEPS=, names no step"},
      {{{"TETRA_TEST_FAULT", "nan-loss"}, {"TETRA_TEST_FAULT_STEPS", "1"}, {"TETRA_TEST_FAULT_RANK", "4294967296"}},
       "TETRA_TEST_FAULT_RANK=4294967296 is not a rank"},
  };
  for (const auto& [vars, want] : cases) {
    INFO(want);
    const Environment env(vars);
    CHECK_THROWS_AS(read_runtime_options(), InputError);
    CHECK_THROWS_WITH(read_runtime_options(), Contains(want));
  }
}

TEST_CASE("runtime options: a value the variable cannot take names the variable", "[runtime_options]") {
  for (const char* path : {"auto", "fused", "cudnn"}) {
    const Environment env(Vars{{"TETRA_ATTENTION", path}});
    CHECK(read_runtime_options().attention == path);
  }
  const Environment env(Vars{{"TETRA_ATTENTION", "flash"}});
  CHECK_THROWS_AS(read_runtime_options(), InputError);
  CHECK_THROWS_WITH(read_runtime_options(),
                    Contains("TETRA_ATTENTION=flash") && Contains("not one of auto, fused, cudnn"));
}

TEST_CASE("runtime options: environment_variable reads the process environment", "[runtime_options]") {
  setenv("TETRA_TEST_RUNTIME_OPTIONS_VAR", "/srv/x", 1);
  CHECK(std::string(environment_variable("TETRA_TEST_RUNTIME_OPTIONS_VAR")) == "/srv/x");
  unsetenv("TETRA_TEST_RUNTIME_OPTIONS_VAR");
  CHECK(environment_variable("TETRA_TEST_RUNTIME_OPTIONS_VAR") == nullptr);
}
