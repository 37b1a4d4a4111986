// Errors. Library code never exits: it throws tetra::Error (a bug or a runtime failure) or
// tetra::ConfigError (bad user input, exit code 2 at the top level). main() decides the exit code.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace tetra {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad input from the user (config, data files, command line): reported, exit code 2.
class InputError : public Error {
 public:
  using Error::Error;
};

}  // namespace tetra

#define TETRA_CHECK(cond, ...)                                                                  \
  do {                                                                                          \
    if (!(cond))                                                                                \
      throw ::tetra::Error(fmt::format("{}:{}: check failed: {}: {}", __FILE__, __LINE__, #cond, \
                                       fmt::format(__VA_ARGS__)));                              \
  } while (0)

#define TETRA_INPUT_CHECK(cond, ...)                                      \
  do {                                                                    \
    if (!(cond)) throw ::tetra::InputError(fmt::format(__VA_ARGS__));     \
  } while (0)
