// `flatshardctl checkpoint save|load|import|inspect|export` (README "Checkpoints").
//
// save, load and import ask a running flatshardd (AdminService.SaveCheckpoint /
// LoadCheckpoint, streaming progress: a progress bar on a terminal, nothing else otherwise);
// inspect and export work offline on a checkpoint directory (no daemon).

#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <iostream>

#include <nlohmann/json.hpp>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli/admin_command.h"
#include "client/cli/admin_commands.h"
#include "client/cli/flags.h"
#include "common/checkpoint/checkpoint.h"
#include "common/checkpoint/param_source.h"
#include "common/config.h"

namespace flatshard::cli {
namespace {

constexpr char kUsage[] =
    "Usage: flatshardctl checkpoint SUBCOMMAND [FLAGS]\n"
    "\n"
    "Checkpoints of registered modules (format flatshard.checkpoint/1: one file per rank and\n"
    "metadata.json, written last) and safetensors files of the full model.\n"
    "\n"
    "Subcommands asking a running flatshardd (paths are on the daemon's host):\n"
    "  save GROUP --dir DIR [--module M]      write the module's committed step to DIR\n"
    "                                         (shards and the daemon's optimizer state)\n"
    "  load GROUP --dir DIR [--module M]      load a checkpoint (any world size or wrap policy)\n"
    "  import GROUP --file F.safetensors [--module M]\n"
    "                                         load a full state dict from a safetensors file\n"
    "Offline (no daemon):\n"
    "  inspect DIR [--no-verify] [--json]     generation, world size, module, params, bytes,\n"
    "                                         optimizer states, validation (checksums)\n"
    "  export DIR --out F.safetensors [--json]\n"
    "                                         the full model as safetensors (state_dict keys;\n"
    "                                         parameters only)\n"
    "\n"
    "Run 'flatshardctl checkpoint SUBCOMMAND --help' for a subcommand's flags.\n";

// An absolute path (the daemon resolves nothing relative to the CLI's directory).
std::string Absolute(const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  char cwd[PATH_MAX];
  if (::getcwd(cwd, sizeof(cwd)) == nullptr) return path;
  return absl::StrCat(cwd, "/", path);
}

// "[##########..........]  52%  512.0 MiB / 1.0 GiB  writing"
std::string Bar(const v1::CheckpointProgress& p) {
  const double f = p.total_bytes() > 0
                       ? std::min(1.0, static_cast<double>(p.done_bytes()) / p.total_bytes())
                       : 0.0;
  const int filled = static_cast<int>(f * 30);
  return absl::StrFormat("[%s%s] %3d%%  %s / %s  %s (%.1fs)", std::string(filled, '#'),
                         std::string(30 - filled, '.'), static_cast<int>(f * 100),
                         HumanBytes(p.done_bytes()), HumanBytes(p.total_bytes()), p.phase(),
                         p.elapsed_seconds());
}

nlohmann::json ProgressJson(const v1::CheckpointProgress& p) {
  return {{"done", p.done()},
          {"generation", p.generation()},
          {"bytes", p.total_bytes()},
          {"files", p.files()},
          {"ranks", p.ranks()},
          {"path", p.dir()},
          {"unused_tensors", p.unused_tensors()},
          {"elapsed_seconds", p.elapsed_seconds()}};
}

// Reads a progress stream to its end; prints the bar on a terminal and the result.
int Stream(AdminCall& call, grpc::ClientReader<v1::CheckpointProgress>& reader,
           grpc::ClientContext& ctx, const std::string& verb) {
  (void)ctx;
  const bool bar = !call.json() && ::isatty(STDERR_FILENO) == 1;
  v1::CheckpointProgress last, p;
  bool any = false;
  while (reader.Read(&p)) {
    last = p;
    any = true;
    if (bar) std::cerr << "\r\033[K" << Bar(p) << std::flush;
  }
  const grpc::Status status = reader.Finish();
  if (bar && any) std::cerr << "\r\033[K" << std::flush;
  if (!status.ok()) return call.Fail(status);
  if (!any || !last.done()) return call.Error("the daemon ended the stream without a result", 1);
  if (call.json()) {
    std::cout << ProgressJson(last).dump(2) << "\n";
  } else {
    std::cout << absl::StrFormat("%s %s: generation %d, %s in %d file(s), %d rank(s), %.2fs\n",
                                 verb, last.dir(), last.generation(),
                                 HumanBytes(last.total_bytes()), last.files(), last.ranks(),
                                 last.elapsed_seconds());
    if (last.unused_tensors() > 0) {
      std::cout << "  (" << last.unused_tensors()
                << " tensor(s) of the source are not parameters of the module and were skipped)\n";
    }
  }
  return 0;
}

const std::string kModuleHelp = "the registered module path (default \"\": the root)";
const std::string kWaitHelp =
    "how long the daemon waits for commits in flight before the checkpoint starts, and the "
    "call's extra deadline (default 30000)";

int Save(const std::vector<std::string>& args) {
  AdminCommandSpec spec;
  spec.name = "checkpoint save";
  spec.synopsis = "GROUP --dir DIR";
  spec.args_name = "GROUP";
  spec.min_args = spec.max_args = 1;
  spec.flags = {{"dir", "DIR", "checkpoint directory (created; an existing one is replaced)"},
                {"module", "M", kModuleHelp}};
  spec.default_timeout_ms = 30000;
  spec.timeout_help = kWaitHelp;
  spec.description =
      "Writes the committed step of a registered module (its committed shards: the same\n"
      "generation on every rank) to DIR: every rank's file in parallel, metadata.json last.\n"
      "Trainers keep running; a commit that lands while the files are written waits for them.\n"
      "A group over several daemons: every daemon writes its own ranks' files, so DIR must be\n"
      "on a file system they all see. On a terminal a progress bar shows on stderr.\n";
  return RunAdminCommand(
      spec, args,
      [](AdminCall& call) {
        v1::SaveCheckpointRequest request;
        request.set_group(call.args()[0]);
        request.set_module(call.flags().Get("module").value_or(""));
        request.set_dir(Absolute(*call.flags().Get("dir")));
        request.set_timeout_ms(call.timeout_ms());
        grpc::ClientContext ctx;
        call.SetDeadline(ctx, absl::Hours(24));  // the transfer itself has no deadline
        auto reader = call.stub().SaveCheckpoint(&ctx, request);
        return Stream(call, *reader, ctx, "saved");
      },
      [](const AdminCall& call) -> std::string {
        return call.flags().Has("dir") ? "" : "--dir DIR is required";
      });
}

int Load(const std::vector<std::string>& args, bool import) {
  AdminCommandSpec spec;
  spec.name = import ? "checkpoint import" : "checkpoint load";
  spec.synopsis = import ? "GROUP --file FILE.safetensors" : "GROUP --dir DIR";
  spec.args_name = "GROUP";
  spec.min_args = spec.max_args = 1;
  if (import) {
    spec.flags = {
        {"file", "FILE", "a safetensors file whose keys are the module's state_dict FQNs"}};
  } else {
    spec.flags = {{"dir", "DIR", "a checkpoint directory"}};
  }
  spec.flags.push_back({"module", "M", kModuleHelp});
  spec.default_timeout_ms = 30000;
  spec.timeout_help = kWaitHelp;
  spec.description = absl::StrCat(
      import ? "Loads a full state dict from a safetensors file into a registered module.\n"
             : "Loads a checkpoint into a registered module, resharding by parameter FQN and\n"
               "element range when its world size or wrap policy differs from the saved one.\n",
      "Everything is checked first (metadata, checksums, FQNs, shapes, dtypes; an error names\n"
      "the file or parameter); then every rank's shards and committed copies are written, so\n"
      "the load is a committed step",
      import ? " (generation: the module's + 1)" : " (generation: the checkpoint's)",
      ". Trainers must read their\nviews again (re-register or reattach) before they commit. "
      "No summon of the module may be open.\n");
  return RunAdminCommand(
      spec, args,
      [import](AdminCall& call) {
        v1::LoadCheckpointRequest request;
        request.set_group(call.args()[0]);
        request.set_module(call.flags().Get("module").value_or(""));
        if (import) {
          request.set_safetensors(Absolute(*call.flags().Get("file")));
        } else {
          request.set_dir(Absolute(*call.flags().Get("dir")));
        }
        request.set_timeout_ms(call.timeout_ms());
        grpc::ClientContext ctx;
        call.SetDeadline(ctx, absl::Hours(24));
        auto reader = call.stub().LoadCheckpoint(&ctx, request);
        return Stream(call, *reader, ctx, import ? "imported" : "loaded");
      },
      [import](const AdminCall& call) -> std::string {
        if (import) return call.flags().Has("file") ? "" : "--file FILE is required";
        return call.flags().Has("dir") ? "" : "--dir DIR is required";
      });
}

int OfflineError(const std::string& sub, const std::string& message, int code) {
  std::string m = message;
  for (char& c : m) {
    if (c == '\n') c = ' ';
  }
  std::cerr << "flatshardctl checkpoint " << sub << ": " << m << "\n";
  return code;
}

int Inspect(const std::vector<std::string>& args) {
  const std::vector<FlagSpec> flags = {
      {"no-verify", "", "skip reading the data files' checksums (metadata and sizes only)"},
      {"json", "", "print JSON"},
      {"help", "", "show this help"}};
  std::vector<std::string> rest;
  std::vector<std::string> flag_args;
  for (const std::string& a : args) (a.rfind("--", 0) == 0 ? flag_args : rest).push_back(a);
  absl::StatusOr<ParsedFlags> parsed = ParseFlags(flags, flag_args);
  if (!parsed.ok()) return OfflineError("inspect", std::string(parsed.status().message()), 2);
  if (parsed->Has("help")) {
    std::cout << "Usage: flatshardctl checkpoint inspect DIR [--no-verify] [--json]\n\n"
                 "Reads a checkpoint directory without a daemon: generation, world size, module,\n"
                 "parameters, bytes per file, and whether it is valid (metadata, sizes and each\n"
                 "file's CRC-32C).\n\nFlags:\n"
              << FlagsHelp(flags)
              << "\nExit status: 0 a valid checkpoint; 1 an invalid one (the failed check is\n"
                 "printed, naming the file); 2 bad flags.\n";
    return 0;
  }
  if (rest.size() != 1) return OfflineError("inspect", "expected one argument: DIR", 2);
  const std::string dir = rest[0];
  absl::StatusOr<checkpoint::Checkpoint> c = checkpoint::OpenCheckpoint(dir);
  absl::Status valid = c.ok() ? absl::OkStatus() : c.status();
  if (c.ok() && !parsed->Has("no-verify")) valid = checkpoint::VerifyFiles(*c, {});
  if (!c.ok()) {
    if (parsed->Has("json")) {
      std::cout << nlohmann::json{{"dir", dir},
                                  {"valid", false},
                                  {"error", std::string(c.status().message())}}
                       .dump(2)
                << "\n";
      return 1;
    }
    return OfflineError("inspect", std::string(c.status().message()), 1);
  }
  const checkpoint::Metadata& m = c->meta;
  int64_t params = 0, elements = 0;
  for (const PlanUnit& u : m.plan.units) {
    params += static_cast<int64_t>(u.params.size());
    elements += u.numel;
  }
  // Optimizer state: per spec, its bytes over every rank and unit.
  std::vector<int64_t> state_bytes(m.state_specs.size(), 0);
  for (const auto& t : m.tensors) {
    for (size_t k = 0; k < m.state_specs.size(); ++k) {
      if (t.name == m.state_specs[k].name) state_bytes[k] += t.bytes;
    }
  }
  if (parsed->Has("json")) {
    nlohmann::json states = nlohmann::json::array();
    for (size_t k = 0; k < m.state_specs.size(); ++k) {
      const StateSpec& st = m.state_specs[k];
      states.push_back({{"name", st.name},
                        {"dtype", std::string(DTypeName(st.dtype))},
                        {"shape", StateShapeName(st.shape)},
                        {"bytes", state_bytes[k]}});
    }
    nlohmann::json files = nlohmann::json::array();
    for (const auto& f : m.files) {
      files.push_back({{"name", f.name},
                       {"rank", f.rank},
                       {"bytes", f.bytes},
                       {"crc32c", absl::StrFormat("%08x", f.crc32c)}});
    }
    nlohmann::json names = nlohmann::json::array();
    for (const auto& t : m.tensors) names.push_back(t.name);
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    std::cout << nlohmann::json{{"dir", dir},
                                {"format", std::string(checkpoint::kFormat)},
                                {"module", m.module},
                                {"group", m.group},
                                {"world_size", m.world_size},
                                {"generation", m.generation},
                                {"created", m.created},
                                {"units", m.plan.units.size()},
                                {"params", params},
                                {"elements", elements},
                                {"bytes", m.total_bytes()},
                                {"tensor_names", names},
                                {"files", files},
                                {"optimizer_state", states},
                                {"verified", !parsed->Has("no-verify")},
                                {"valid", valid.ok()},
                                {"error", valid.ok() ? "" : std::string(valid.message())}}
                     .dump(2)
              << "\n";
    return valid.ok() ? 0 : 1;
  }
  std::cout << absl::StrFormat(
      "checkpoint %s\n  format %s, module %s, group %s\n  generation %d, world size %d, %d "
      "units, %d params (%d elements)\n  %s in %d files, created %s\n",
      dir, checkpoint::kFormat, ModuleName(m.module), m.group, m.generation, m.world_size,
      m.plan.units.size(), params, elements, HumanBytes(m.total_bytes()), m.files.size(),
      m.created);
  std::vector<std::vector<std::string>> rows = {{"UNIT", "MODULE", "PARAMS", "ELEMENTS", "DTYPE"}};
  for (const PlanUnit& u : m.plan.units) {
    rows.push_back({absl::StrCat(u.index), ModuleName(u.module), absl::StrCat(u.params.size()),
                    absl::StrCat(u.numel), std::string(DTypeName(u.dtype))});
  }
  std::cout << FormatTable(rows, "  ");
  if (m.state_specs.empty()) {
    std::cout << "optimizer state: none (parameters only)\n";
  } else {
    std::vector<std::vector<std::string>> srows = {{"STATE", "DTYPE", "SHAPE", "BYTES"}};
    for (size_t k = 0; k < m.state_specs.size(); ++k) {
      const StateSpec& st = m.state_specs[k];
      srows.push_back({st.name, std::string(DTypeName(st.dtype)), StateShapeName(st.shape),
                       HumanBytes(state_bytes[k])});
    }
    std::cout << "optimizer state (every rank and unit):\n" << FormatTable(srows, "  ");
  }
  if (parsed->Has("no-verify")) {
    std::cout << "valid: metadata and file sizes (checksums not read)\n";
  } else if (valid.ok()) {
    std::cout << "valid: metadata, file sizes and every file's CRC-32C\n";
  } else {
    std::cout << "INVALID: " << valid.message() << "\n";
  }
  return valid.ok() ? 0 : 1;
}

int Export(const std::vector<std::string>& args) {
  const std::vector<FlagSpec> flags = {{"out", "FILE", "the safetensors file to write; required"},
                                       {"json", "", "print JSON"},
                                       {"help", "", "show this help"}};
  std::vector<std::string> rest, flag_args;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].rfind("--", 0) == 0) {
      flag_args.push_back(args[i]);
      if (args[i] == "--out" && i + 1 < args.size()) flag_args.push_back(args[++i]);
    } else {
      rest.push_back(args[i]);
    }
  }
  absl::StatusOr<ParsedFlags> parsed = ParseFlags(flags, flag_args);
  if (!parsed.ok()) return OfflineError("export", std::string(parsed.status().message()), 2);
  if (parsed->Has("help")) {
    std::cout << "Usage: flatshardctl checkpoint export DIR --out FILE.safetensors [--json]\n\n"
                 "Writes the full model of a checkpoint as a safetensors file, without a daemon:\n"
                 "one tensor per key of the unwrapped module's state_dict (tied parameters under\n"
                 "every name, each a copy), whole, dtype and shape as in the module. Buffers are\n"
                 "not in checkpoints (the daemon does not hold them). The checkpoint is verified\n"
                 "first (checksums).\n\nFlags:\n"
              << FlagsHelp(flags)
              << "\nExit status: 0 written; 1 an invalid checkpoint or an "
                 "I/O error; 2 bad flags.\n";
    return 0;
  }
  if (rest.size() != 1) return OfflineError("export", "expected one argument: DIR", 2);
  if (!parsed->Has("out")) return OfflineError("export", "--out FILE is required", 2);
  absl::StatusOr<checkpoint::Checkpoint> c = checkpoint::OpenCheckpoint(rest[0]);
  if (!c.ok()) return OfflineError("export", std::string(c.status().message()), 1);
  if (absl::Status v = checkpoint::VerifyFiles(*c, {}); !v.ok()) {
    return OfflineError("export", std::string(v.message()), 1);
  }
  const std::string out = *parsed->Get("out");
  absl::Status s =
      checkpoint::ExportSafetensors(*checkpoint::CheckpointSource(*c), c->meta.plan, out,
                                    {{"format", "pt"},
                                     {"flatshard.module", c->meta.module},
                                     {"flatshard.generation", absl::StrCat(c->meta.generation)}},
                                    nullptr, c->meta.tied);
  if (!s.ok()) return OfflineError("export", std::string(s.message()), 1);
  int64_t tensors = 0;
  for (const PlanUnit& u : c->meta.plan.units) {
    tensors += static_cast<int64_t>(u.params.size() + u.shared.size());
  }
  tensors += static_cast<int64_t>(c->meta.tied.size());
  if (parsed->Has("json")) {
    std::cout << nlohmann::json{{"out", out},
                                {"tensors", tensors},
                                {"generation", c->meta.generation}}
                     .dump(2)
              << "\n";
  } else {
    std::cout << "exported " << tensors << " tensors (generation " << c->meta.generation << ") to "
              << out << "\n";
  }
  return 0;
}

}  // namespace

int RunCheckpointCommand(const std::vector<std::string>& args) {
  if (args.empty()) {
    std::cerr << kUsage;
    return 2;
  }
  const std::string sub = args[0];
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (sub == "--help" || sub == "-h" || sub == "help") {
    std::cout << kUsage;
    return 0;
  }
  if (sub == "save") return Save(rest);
  if (sub == "load") return Load(rest, /*import=*/false);
  if (sub == "import") return Load(rest, /*import=*/true);
  if (sub == "inspect") return Inspect(rest);
  if (sub == "export") return Export(rest);
  return OfflineError(sub, "unknown subcommand (see flatshardctl checkpoint --help)", 2);
}

}  // namespace flatshard::cli
