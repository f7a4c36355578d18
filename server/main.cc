// flatshardd: parses flags, runs the Daemon until SIGTERM or SIGINT. Nothing else.

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <iostream>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "common/file_system.h"
#include "common/logging.h"
#include "server/access/access_control.h"
#include "server/daemon.h"
#include "server/durable/default_state_dir.h"
#include "server/systemd_notify.h"

ABSL_FLAG(std::string, socket, "/run/flatshard/flatshardd.sock",
          "Unix socket trainers and flatshardctl connect to");
ABSL_FLAG(std::string, tcp_address, "",
          "optional TCP address for remote clients, e.g. 127.0.0.1:7450 (empty: none)");
ABSL_FLAG(std::string, segment_prefix, "flatshard",
          "name prefix of the daemon's shared-memory segments in /dev/shm");
ABSL_FLAG(int64_t, memory_limit_mib, 0, "limit on shard and buffer memory in MiB (0: none)");
ABSL_FLAG(absl::Duration, default_wait, absl::Seconds(60),
          "how long a collective call without a deadline waits for the other ranks");
ABSL_FLAG(absl::Duration, lease_timeout, absl::Seconds(10),
          "how long a rank whose join completed may take to open its lease (the client's Lease "
          "stream) before the daemon ends its session; a trainer that died inside JoinGroup "
          "frees its rank after this");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(5),
          "how long in-flight calls may take to finish on SIGTERM");
ABSL_FLAG(std::string, peer_address, "",
          "TCP address (host:port) of this daemon's PeerService, for groups whose ranks live on "
          "several daemons; trainers name the coordinator daemon's address when they join, and "
          "peers reach this daemon at it (so use a routable host, not 0.0.0.0). Empty: local "
          "groups only. Port 0 picks a free port");
ABSL_FLAG(std::string, peer_address_file, "",
          "once listening, write the PeerService's address (with the port it got) to this file "
          "(for scripts and tests that start daemons on port 0)");
ABSL_FLAG(std::string, node_name, "", "this daemon's node name in peer tables (empty: host name)");
ABSL_FLAG(std::string, ucx_error_handling, "auto",
          "'auto' and 'peer': UCX detects every dead peer itself; daemons on this host talk over "
          "TCP loopback (UCX 1.13's shared memory cannot report a dead peer, and a daemon killed "
          "mid-send wedges its peers' shared-memory receive queue for good); 'none': no endpoint "
          "has UCX peer error handling, daemons on this host use shared memory and their death "
          "is found by the heartbeats (--peer_timeout). Daemons of one host must not mix 'none' "
          "with the others");
ABSL_FLAG(bool, ucx_hierarchical, true,
          "groups whose daemons each host the same number (>= 2) of ranks run all-gather and "
          "reduce-scatter hierarchically (copies within a daemon, each daemon's bytes over the "
          "network once); false: the flat ring. Every daemon of a group must agree");
ABSL_FLAG(bool, ucx_same_host_copy, true,
          "messages of 256 KiB and more to a daemon on this host are copied once, straight out "
          "of the sender's buffer (process_vm_readv), instead of through UCX (TCP loopback, or "
          "shared memory with --ucx_error_handling=none); a dead peer fails only that op. "
          "false: UCX for every size");
ABSL_FLAG(absl::Duration, heartbeat_interval, absl::Milliseconds(500),
          "heartbeats between daemons of multi-daemon groups");
ABSL_FLAG(absl::Duration, peer_timeout, absl::Seconds(3),
          "a peer daemon silent this long is declared dead and its groups' collectives fail");
// Access control (README "Access control").
ABSL_FLAG(std::string, socket_group, "",
          "group (name or gid) the Unix socket is chown'ed to; the socket is mode 0660, so "
          "members of this group may connect (empty: the daemon's own group)");
ABSL_FLAG(std::string, allowed_uids, "",
          "comma-separated uids that may use the Unix socket besides the daemon's own uid "
          "(empty: every uid that can open the socket). Groups are kept apart by uid anyway");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) of this daemon for mutual TLS on --tcp_address and "
          "--peer_address and for channels to peer daemons");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificate(s): clients and peers must present a certificate it signed");
ABSL_FLAG(bool, allow_insecure_tcp, false,
          "without TLS, serve --tcp_address / --peer_address on non-loopback addresses anyway "
          "(unauthenticated: anyone who can reach the port and guess a token gets in)");

ABSL_FLAG(std::string, metrics_address, "",
          "serve Prometheus metrics at http://HOST:PORT/metrics, e.g. 127.0.0.1:9450 (empty: "
          "off). Port 0 picks a free port");
ABSL_FLAG(std::string, metrics_address_file, "",
          "once listening, write the metrics endpoint's host:port to this file");
ABSL_FLAG(std::string, gpus, "",
          "GPUs that host ranks: empty or 'none' (host memory, the default), 'all', or ordinals "
          "'0,1'; rank r of a group lives on the (r mod n)-th");
ABSL_FLAG(int64_t, gpu_memory_limit_mib, 0,
          "per GPU: device memory the daemon's pool may reserve, in MiB (0: no limit)");
ABSL_FLAG(std::string, gpu_collectives, "auto",
          "how device memory moves: auto (NCCL where every rank has its own GPU, else staged "
          "through host memory), nccl (fail without NCCL), host (never NCCL)");
ABSL_FLAG(int, simulate_gpus, 0,
          "testing only: N simulated GPUs whose device memory is host shared memory (no CUDA, "
          "no NCCL), to run the GPU code paths without a GPU; trainers must open it through "
          "the test harness");
ABSL_FLAG(bool, gpu_device_ordering, true,
          "a summon whose work is device copies only (world 1, NO_SHARD) waits for the trainer's "
          "event on the GPU's stream and is answered once its copies are enqueued (no host wait); "
          "false: the host waits for the trainer's event first, as for collectives");
ABSL_FLAG(absl::Duration, simulate_gpu_delay, absl::ZeroDuration(),
          "testing only, with --simulate_gpus: each operation of a simulated GPU's stream starts "
          "this late, so that work not ordered after it sees old bytes");
// Resources (README "Resources and quotas").
ABSL_FLAG(absl::Duration, group_idle_timeout, absl::Hours(1),
          "a group in which no rank has had a session for this long is removed with its shards "
          "(logged); 0: never. `flatshardctl delete-group` removes one at once");
ABSL_FLAG(int32_t, max_groups_per_uid, 64,
          "groups one uid may have on this daemon at a time (0: no quota)");
ABSL_FLAG(int64_t, memory_quota_mib_per_uid, 0,
          "host memory (shards and buffers) one uid's groups may hold, in MiB (0: no quota; "
          "--memory_limit_mib bounds all uids together)");
ABSL_FLAG(int64_t, gpu_memory_quota_mib_per_uid, 0,
          "device memory one uid may hold on this daemon's GPUs together, in MiB (published "
          "device versions, device shards; 0: no quota; --gpu_memory_limit_mib bounds each GPU)");
ABSL_FLAG(int64_t, max_segments_per_uid, -1,
          "shared-memory segments (one descriptor each) one uid's groups may hold; -1: half of "
          "the daemon's segment budget; 0: no quota");
ABSL_FLAG(int64_t, fd_reserve, 1024,
          "descriptors kept for sockets and files: the daemon raises its descriptor soft limit "
          "to the hard limit at start and refuses new segments (RESOURCE_EXHAUSTED) beyond the "
          "limit minus this reserve");
ABSL_FLAG(std::string, state_dir, "",
          "restarts: directory for the groups' records (created 0700), so that a restarted "
          "daemon re-adopts the shards it finds; default: $STATE_DIRECTORY (systemd), else "
          "/var/lib/flatshard/state for root, else $XDG_STATE_HOME/flatshard/state or "
          "~/.local/state/flatshard/state; one daemon per directory");
ABSL_FLAG(bool, ephemeral, false,
          "keep no records: a restart loses every group's shards (logged as a warning); "
          "for tests and throwaway daemons; not with --state_dir");
ABSL_FLAG(int32_t, weights_keep, 2,
          "published weights: newest versions kept per name (README \"Publishing weights\"); "
          "older ones are freed once no reader holds them");
ABSL_FLAG(std::vector<std::string>, weights_sources, {},
          "published weights across daemons: comma-separated peer addresses (host:port of their "
          "--peer_address) of daemons of the publishing group; a reader that opens a name here "
          "gets a local copy of the newest (or asked) version, copied once from them; names "
          "that local readers watch are followed there and each new version copied as it "
          "appears (README \"Published weights across daemons\")");
ABSL_FLAG(bool, keep_shards, true,
          "unless --ephemeral: SIGTERM leaves shards, gradient shards and committed copies "
          "(and their records) for the next daemon; false: SIGTERM frees everything");
ABSL_FLAG(bool, state_fsync, true,
          "fsync each state record write (a journal append, or a base rewrite and its directory); "
          "false: no fsync, appends and renames alone (records then "
          "survive the daemon's death, kill -9 or OOM, but not a machine crash, which the "
          "shared-memory shards do not survive either); saves the fsyncs of every commit");
ABSL_FLAG(std::string, weights_transport, "ucx",
          "how versions of published weights move between daemons (--weights_sources, the "
          "publish leader to the group's other daemons): 'ucx' (the copier reads the source's "
          "registered segment with UCX gets; gRPC where either side cannot do UCX) or 'grpc' "
          "(the bytes in the FetchVersion stream)");
ABSL_FLAG(absl::Duration, testing_weights_copy_pause, absl::ZeroDuration(),
          "testing only: a copy of published weights to another daemon sends its descriptor, "
          "then waits this long before the bytes");
ABSL_FLAG(int, testing_weights_ucx_stall_after, 0,
          "testing only: sending its Nth UCX rkey to a copier, this daemon's UCX weights worker "
          "stops progressing for good (a get that needs this side's progress, e.g. over TCP, "
          "stays in flight until the daemon dies; its own later copies hang); 0: never");
ABSL_FLAG(absl::Duration, testing_commit_copy_pause, absl::ZeroDuration(),
          "testing only: each commit copy tears its committed copy and pauses this long");
ABSL_FLAG(std::string, testing_hold_begin_reduce_scatter, "",
          "testing only: a FIFO; each ReduceScatterGrads begin writes a line to the FIFO "
          "<FIFO>.held, then waits until a writer opens <FIFO>, before it allocates");
ABSL_FLAG(std::string, log_level, "info",
          "lowest severity logged: info, warning or error (changeable at run time)");
ABSL_FLAG(int, v, 0, "verbose logging level (per-op lines at 2)");
ABSL_FLAG(std::string, log_format, "text",
          "text: one line per record with key=value ids; json: one JSON object per line");

namespace {

// Writes `content` and a newline to `file` ("<file>.tmp", renamed), so a reader never sees
// half an address. No fsync: the file only matters while this daemon runs. False (with a
// message on stderr) on failure.
bool WriteAddressFile(const std::string& file, const std::string& content) {
  flatshard::AtomicWriteOptions options;
  options.sync = false;
  options.mode = 0666;  // as std::ofstream made it: the umask decides
  options.temp_suffix = ".tmp";
  if (absl::Status s = flatshard::WriteFileAtomically(flatshard::FileSystem::Posix(), file,
                                                      content + "\n", options);
      !s.ok()) {
    std::cerr << "flatshardd: cannot write " << s.message() << "\n";
    return false;
  }
  return true;
}

// Whether `file` (a flag's definition site, as __FILE__ spelled it) is this file.
bool IsOwnFlagFile(absl::string_view file) { return absl::EndsWith(file, "server/main.cc"); }

// Whether argv asks for help: --help (this binary's flags) or --helpfull (every flag). Abseil
// answers these itself with exit status 1 and headings naming each flag's source file on the
// build host, so main answers them before Abseil parses.
enum class Help { kNone, kOwn, kFull };
Help RequestedHelp(int argc, char** argv) {
  Help help = Help::kNone;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg == "--help" || arg == "-help" || arg == "-h") help = std::max(help, Help::kOwn);
    if (arg == "--helpfull" || arg == "-helpfull") help = Help::kFull;
  }
  return help;
}

// "    --name (help); default: value;" per flag, sorted by name, wrapped at 80 columns as
// Abseil's own listing is.
void PrintHelp(std::ostream& out, Help help) {
  out << absl::ProgramUsageMessage() << "\n\nFlags:\n";
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (help == Help::kFull || IsOwnFlagFile(flag->Filename())) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  for (const absl::CommandLineFlag* flag : flags) {
    const std::string value = flag->DefaultValue();
    // Words wrap; "default: VALUE;" stays on one line (scripts parse it, as from Abseil's).
    std::vector<std::string> words = {absl::StrCat("--", flag->Name())};
    for (absl::string_view word :
         absl::StrSplit(absl::StrCat("(", flag->Help(), ");"), ' ', absl::SkipEmpty())) {
      words.emplace_back(word);
    }
    words.push_back(absl::StrCat(
        "default: ", flag->IsOfType<std::string>() ? absl::StrCat("\"", value, "\"") : value, ";"));
    std::string line = "    ";
    bool line_empty = true;
    for (const std::string& word : words) {
      if (!line_empty && line.size() + 1 + word.size() > 80) {
        out << line << "\n";
        line = "      ";
        line_empty = true;
      }
      absl::StrAppend(&line, line_empty ? "" : " ", word);
      line_empty = false;
    }
    out << line << "\n";
  }
}

int g_signal_pipe[2] = {-1, -1};

void OnSignal(int sig) {
  // Async-signal-safe: one write(); a second signal while shutting down is ignored.
  const int saved = errno;
  ssize_t ignored = write(g_signal_pipe[1], &sig, sizeof(sig));
  (void)ignored;
  errno = saved;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "flatshardd: the flatshard per-node daemon. Owns the shards of training jobs' flattened "
      "parameters in shared memory and serves trainers over gRPC.\n"
      "Usage: flatshardd [--socket PATH] [--tcp_address HOST:PORT] [--segment_prefix P] "
      "[--memory_limit_mib N] [--peer_address HOST:PORT --node_name NAME]");
  absl::FlagsUsageConfig usage;
  // --help lists this binary's flags, not those of every library linked in.
  usage.contains_help_flags = IsOwnFlagFile;
  // Abseil's other listings (--helpshort, --help=SUBSTR, ...) name files relative to the
  // source tree, never the build host's path to it.
  usage.normalize_filename = [](absl::string_view file) {
    const size_t own = file.rfind("server/main.cc");
    return std::string(own == absl::string_view::npos ? file : file.substr(own));
  };
  usage.version_string = [] { return std::string("flatshardd ") + FS_VERSION_STRING + "\n"; };
  absl::SetFlagsUsageConfig(usage);
  if (const Help help = RequestedHelp(argc, argv); help != Help::kNone) {
    PrintHelp(std::cout, help);
    return 0;
  }
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = flatshard::SetLogLevel(absl::GetFlag(FLAGS_log_level)); !s.ok()) {
    std::cerr << "flatshardd: --log_level: " << s.message() << "\n";
    return 1;
  }
  flatshard::SetVerbosity(absl::GetFlag(FLAGS_v));
  if (auto format = flatshard::ParseLogFormat(absl::GetFlag(FLAGS_log_format)); format.ok()) {
    flatshard::SetLogFormat(*format);
  } else {
    std::cerr << "flatshardd: --log_format: " << format.status().message() << "\n";
    return 1;
  }

  flatshard::server::DaemonConfig config;
  config.socket_path = absl::GetFlag(FLAGS_socket);
  config.tcp_address = absl::GetFlag(FLAGS_tcp_address);
  config.segment_prefix = absl::GetFlag(FLAGS_segment_prefix);
  if (int64_t mib = absl::GetFlag(FLAGS_memory_limit_mib); mib > 0) {
    config.memory_limit_bytes = mib << 20;
  }
  config.default_wait = absl::GetFlag(FLAGS_default_wait);
  config.group_idle_timeout = absl::GetFlag(FLAGS_group_idle_timeout);
  config.max_groups_per_uid = absl::GetFlag(FLAGS_max_groups_per_uid);
  if (const int64_t mib = absl::GetFlag(FLAGS_memory_quota_mib_per_uid); mib >= 0) {
    config.memory_quota_bytes_per_uid = mib << 20;
  } else {
    std::cerr << "flatshardd: --memory_quota_mib_per_uid must be >= 0, got " << mib << "\n";
    return 1;
  }
  if (const int64_t mib = absl::GetFlag(FLAGS_gpu_memory_quota_mib_per_uid); mib >= 0) {
    config.gpu_memory_quota_bytes_per_uid = mib << 20;
  } else {
    std::cerr << "flatshardd: --gpu_memory_quota_mib_per_uid must be >= 0, got " << mib << "\n";
    return 1;
  }
  config.max_segments_per_uid = absl::GetFlag(FLAGS_max_segments_per_uid);
  config.fd_reserve = absl::GetFlag(FLAGS_fd_reserve);
  config.shutdown_grace = absl::GetFlag(FLAGS_shutdown_grace);
  config.lease_timeout = absl::GetFlag(FLAGS_lease_timeout);
  config.peer_address = absl::GetFlag(FLAGS_peer_address);
  config.node_name = absl::GetFlag(FLAGS_node_name);
  config.heartbeat_interval = absl::GetFlag(FLAGS_heartbeat_interval);
  config.peer_timeout = absl::GetFlag(FLAGS_peer_timeout);
  config.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  config.ucx_error_handling = absl::GetFlag(FLAGS_ucx_error_handling);
  config.ucx_hierarchical = absl::GetFlag(FLAGS_ucx_hierarchical);
  config.ucx_same_host_copy = absl::GetFlag(FLAGS_ucx_same_host_copy);
  config.gpus = absl::GetFlag(FLAGS_gpus);
  if (const int64_t mib = absl::GetFlag(FLAGS_gpu_memory_limit_mib); mib > 0) {
    config.gpu_memory_limit_bytes = mib << 20;
  } else if (mib < 0) {
    std::cerr << "flatshardd: --gpu_memory_limit_mib must be >= 0, got " << mib << "\n";
    return 1;
  }
  config.gpu_collectives = absl::GetFlag(FLAGS_gpu_collectives);
  config.simulate_gpus = absl::GetFlag(FLAGS_simulate_gpus);
  config.gpu_device_ordering = absl::GetFlag(FLAGS_gpu_device_ordering);
  config.simulate_gpu_delay = absl::GetFlag(FLAGS_simulate_gpu_delay);
  absl::StatusOr<flatshard::server::state::StateDirChoice> state_dir =
      flatshard::server::state::ChooseStateDir(
          absl::GetFlag(FLAGS_state_dir), absl::GetFlag(FLAGS_ephemeral),
          [](const char* name) {
            const char* v = std::getenv(name);
            return std::string(v == nullptr ? "" : v);
          },
          ::geteuid());
  if (!state_dir.ok()) {
    std::cerr << "flatshardd: " << state_dir.status().message() << "\n";
    return 1;
  }
  config.state_dir = state_dir->path;
  config.state_dir_why = state_dir->why;
  config.keep_shards = absl::GetFlag(FLAGS_keep_shards);
  config.weights_keep = absl::GetFlag(FLAGS_weights_keep);
  config.weights_sources = absl::GetFlag(FLAGS_weights_sources);
  config.state_fsync = absl::GetFlag(FLAGS_state_fsync);
  config.testing_commit_copy_pause = absl::GetFlag(FLAGS_testing_commit_copy_pause);
  config.testing_hold_begin_reduce_scatter = absl::GetFlag(FLAGS_testing_hold_begin_reduce_scatter);
  config.testing_weights_copy_pause = absl::GetFlag(FLAGS_testing_weights_copy_pause);
  config.testing_weights_ucx_stall_after = absl::GetFlag(FLAGS_testing_weights_ucx_stall_after);
  config.weights_transport = absl::GetFlag(FLAGS_weights_transport);
  config.socket_group = absl::GetFlag(FLAGS_socket_group);
  if (auto uids = flatshard::server::access::ParseUidList(absl::GetFlag(FLAGS_allowed_uids));
      uids.ok()) {
    config.allowed_uids = *std::move(uids);
  } else {
    std::cerr << "flatshardd: " << uids.status().message() << "\n";
    return 1;
  }
  config.tls.cert = absl::GetFlag(FLAGS_tls_cert);
  config.tls.key = absl::GetFlag(FLAGS_tls_key);
  config.tls.ca = absl::GetFlag(FLAGS_tls_ca);
  config.allow_insecure_tcp = absl::GetFlag(FLAGS_allow_insecure_tcp);

  // gRPC's static initialisers may start threads before main, so masking signals here
  // cannot route them to one thread; a handler works on whichever thread the kernel picks.
  // It only writes the signal number to a pipe; a thread reads it and shuts the daemon down.
  // Installed before the daemon listens: a SIGTERM that arrives as soon as a client can see
  // the socket waits in the pipe for the thread below instead of killing the process.
  if (pipe(g_signal_pipe) != 0) {
    std::cerr << "flatshardd: pipe: " << std::strerror(errno) << "\n";
    return 1;
  }
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  auto daemon = flatshard::server::Daemon::Create(config);
  if (!daemon.ok()) {
    std::cerr << "flatshardd: " << daemon.status().message() << "\n";
    return 1;
  }
  if (const std::string file = absl::GetFlag(FLAGS_peer_address_file); !file.empty()) {
    if (!WriteAddressFile(file, (*daemon)->peer_address())) return 1;
  }
  if (const std::string file = absl::GetFlag(FLAGS_metrics_address_file); !file.empty()) {
    if (!WriteAddressFile(file, (*daemon)->metrics_address())) return 1;
  }
  // systemd (Type=notify): ready once every socket listens; keep-alives when WatchdogSec= is
  // set. Without $NOTIFY_SOCKET these are no-ops.
  flatshard::server::SystemdNotifier notifier =
      flatshard::server::SystemdNotifier::FromEnvironment();
  if (absl::Status s = notifier.Notify(absl::StrCat(
          "READY=1\nSTATUS=serving on unix:", config.socket_path,
          config.tcp_address.empty() ? "" : " and " + config.tcp_address,
          (*daemon)->metrics_address().empty() ? ""
                                               : ", metrics on " + (*daemon)->metrics_address(),
          "\nMAINPID=", getpid()));
      !s.ok()) {
    FS_LOG(WARNING) << s;
  }
  notifier.StartWatchdog();
  std::thread signal_thread([&] {
    int sig = 0;
    while (read(g_signal_pipe[0], &sig, sizeof(sig)) < 0 && errno == EINTR) {
    }
    FS_LOG(INFO) << "received signal " << sig;
    notifier.Notify("STOPPING=1\nSTATUS=shutting down").IgnoreError();
    (*daemon)->Shutdown();
  });
  (*daemon)->Wait();
  signal_thread.join();
  notifier.StopWatchdog();
  return 0;
}
