// oscarkv: command-line tool. Add a subcommand by adding a row to kCommands.
#include <cstdio>
#include <cstring>

#include "client/tool/command.h"

namespace oscarkv::tool {
namespace {

constexpr Command kCommands[] = {
    {"calibrate", "fit OSCAR rotations from a Q/K/V activation dump (or --hadamard)",
     RunCalibrate},
    {"import-rotationzoo", "convert published RotationZoo .pt files to a calibration file",
     RunImportRotationZoo},
    {"bench-fidelity", "compare no rotation / Hadamard / OSCAR attention fidelity",
     RunBenchFidelity},
    {"gen-synthetic", "write a synthetic Q/K/V activation dump", RunGenSynthetic},
#ifdef OSCARKV_TOOL_SERVICE
    {"put", "stream a K/V safetensors file into a server as a sequence", RunServicePut},
    {"get", "fetch a sequence (bf16 or compressed) into a safetensors file", RunServiceGet},
    {"attend", "run a decode-attention query on the server (--verify: locally too)",
     RunServiceAttend},
    {"stat", "show one sequence", RunServiceStat},
    {"ls", "list sequences", RunServiceLs},
    {"drop", "drop a sequence", RunServiceDrop},
    {"info", "show the server: backend, pool, models", RunServiceInfo},
#endif
};

void PrintUsage(FILE* out) {
  std::fprintf(out, "usage: oscarkv <command> [flags]   (oscarkv <command> --help)\n\ncommands:\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %-20s %s\n", c.name, c.summary);
}

}  // namespace
}  // namespace oscarkv::tool

int main(int argc, char** argv) {
  using oscarkv::tool::kCommands;
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") ||
      !std::strcmp(argv[1], "help")) {
    oscarkv::tool::PrintUsage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& c : kCommands) {
    if (!std::strcmp(argv[1], c.name)) return c.run(argc - 1, argv + 1);
  }
  std::fprintf(stderr, "oscarkv: unknown command \"%s\"\n\n", argv[1]);
  oscarkv::tool::PrintUsage(stderr);
  return 2;
}
