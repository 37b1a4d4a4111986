// Catch2 v2's console reporter can loop forever wrapping a long test or section name in the
// header it prints before a failure (TextFlow), which turns a failing check into a hang: a width
// no name here reaches keeps it from wrapping.
#define CATCH_CONFIG_CONSOLE_WIDTH 200
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
