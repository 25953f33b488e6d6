// The `oscarkv` command-line tool: one table of subcommands (oscarkv_main.cc),
// each implemented in its own file as `int Run<Name>(int argc, char** argv)`
// where argv[0] is the subcommand name. A subcommand prints errors to stderr
// and returns a process exit code (0 ok, 1 failure, 2 usage error).
#ifndef OSCARKV_CLIENT_TOOL_COMMAND_H_
#define OSCARKV_CLIENT_TOOL_COMMAND_H_

namespace oscarkv::tool {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(int argc, char** argv);
};

// Calibration subcommands (calibrate_command.cc, ...).
int RunCalibrate(int argc, char** argv);
int RunImportRotationZoo(int argc, char** argv);
int RunBenchFidelity(int argc, char** argv);
int RunGenSynthetic(int argc, char** argv);

// Service subcommands (service_commands.cc; built with the client library).
int RunServicePut(int argc, char** argv);
int RunServiceGet(int argc, char** argv);
int RunServiceAttend(int argc, char** argv);
int RunServiceStat(int argc, char** argv);
int RunServiceLs(int argc, char** argv);
int RunServiceDrop(int argc, char** argv);
int RunServiceInfo(int argc, char** argv);

}  // namespace oscarkv::tool

#endif  // OSCARKV_CLIENT_TOOL_COMMAND_H_
