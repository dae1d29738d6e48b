// engine.cpp: the TCPX backend engine (see engine.h).
//
// Connections. Either agent may need to send first, and NIXL often loads metadata one way
// only (the initiator knows the target, the target never loads the initiator's), so "the
// smaller name dials" would deadlock. Instead whoever needs a connection and has none dials,
// then sends a Hello notification naming its agent; the other side's accept thread keeps the
// accepted connection under the peer's address until that Hello names it. If both dial at the
// same moment each side keeps the connection it bound first for its own sends and serves the
// other until disconnect: one-sided operations work on either, and each side always sends on
// the same connection, so its notifications stay ordered after its writes. A Hello also names
// the dialer's endpoint: a Hello from another endpoint than the one this side sends to means
// the agent was replaced under the same name (restarted, re-created), and its new connection
// takes over.
//
// Teardown and failure. Nothing here waits without a bound: dials and set-ups end at the
// endpoint's timeout, the acceptors poll every 5 ms (and are stopped at once when the engine
// goes), deregistration waits for operations
// still being served at most the timeout, and failed connections are closed (the next send
// dials afresh).
//
// First transfers. What a connection's first transfers would pay is paid when it is made or
// bound: every registered region is registered on its one-sided comms then
// (tcpx_connection_warmup), and a region registered later on the existing connections.
// Hot path. prepXfer merges contiguous descriptors once; postXfer looks the connection up
// (one map lookup under a mutex per transfer, not per block) and submits one tcpx write or
// read for the whole list.
//
// Same host. Connection info carries tcpx's same-host info; loading it asks tcpx for the
// route. A VRAM-to-VRAM transfer to a peer on the CUDA IPC route goes through a local
// connection (dialed at first use; the peer's local acceptor keeps its end), its
// notification sent over the network connection once the copies completed, so the peer
// still sees it only after the bytes landed. When the local connection cannot be made (the
// peers share a kernel but not a network namespace), the route is switched off for that
// peer and its transfers take the network path.

#include "engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>

namespace tcpx_nixl {

namespace {

int logLevel() {
    static const int level = [] {
        const char *v = std::getenv("TCPX_NIXL_LOG");
        if (!v) return 0;
        if (!std::strcmp(v, "debug")) return 2;
        if (!std::strcmp(v, "info")) return 1;
        return 0;
    }();
    return level;
}

std::string lastError() {
    const char *e = tcpx_last_error();
    return e && *e ? std::string(e) : std::string("(no message)");
}

std::string statusName(tcpx_status s) { return tcpx_status_str(static_cast<int32_t>(s)); }

/// "what failed: TCPX_ERR_x: tcpx's message" for a failed tcpx call.
std::string failure(const std::string &what, tcpx_status s) {
    return what + ": " + statusName(s) + ": " + lastError();
}

/// Runs an override body, turning any exception into a NIXL status: nothing may unwind into
/// NIXL's core (it is built without expecting it, and a plugin's exception types are not its).
template <class F>
Status guarded(const char *where, F &&body) noexcept {
    try {
        return body();
    } catch (const std::exception &e) {
        logError(std::string(where) + ": " + e.what());
    } catch (...) {
        logError(std::string(where) + ": unknown exception");
    }
    return NIXL_ERR_BACKEND;
}

uint64_t parseUnsigned(const std::string &key, const std::string &value, uint64_t max) {
    size_t used = 0;
    unsigned long long v = 0;
    try {
        v = std::stoull(value, &used, 0);
    } catch (const std::exception &) {
        used = 0;
    }
    if (used != value.size() || value.empty() || value[0] == '-' || v > max) {
        throw std::invalid_argument("backend parameter " + key + "=\"" + value +
                                    "\" is not a number in 0.." + std::to_string(max));
    }
    return v;
}

bool isMemory(MemType t) { return t == DRAM_SEG || t == VRAM_SEG; }

}  // namespace

void logError(const std::string &what) {
    std::fprintf(stderr, "[nixl TCPX] error: %s\n", what.c_str());
}

namespace {
/// Wall-clock seconds (within the day), so that the lines of two agents' logs can be merged.
double uptime() {
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    return std::fmod(std::chrono::duration<double>(now).count(), 86400.0);
}
}  // namespace

void logInfo(const std::string &what) {
    if (logLevel() >= 1) std::fprintf(stderr, "[nixl TCPX %.6f] %s\n", uptime(), what.c_str());
}

void logDebug(const std::string &what) {
    if (logLevel() >= 2) std::fprintf(stderr, "[nixl TCPX %.6f] %s\n", uptime(), what.c_str());
}

Status toNixl(tcpx_status s) {
    switch (s) {
    case TCPX_OK: return NIXL_SUCCESS;
    case TCPX_PENDING: return NIXL_IN_PROG;
    case TCPX_ERR_NULL_POINTER:
    case TCPX_ERR_INVALID_ARGUMENT:
    case TCPX_ERR_BUFFER_TOO_SMALL:
    case TCPX_ERR_CONFIG: return NIXL_ERR_INVALID_PARAM;
    case TCPX_ERR_STALE_HANDLE: return NIXL_ERR_NOT_FOUND;
    case TCPX_ERR_UNSUPPORTED: return NIXL_ERR_NOT_SUPPORTED;
    case TCPX_ERR_CONNECT:
    case TCPX_ERR_TIMEOUT:
    case TCPX_ERR_PEER_CLOSED: return NIXL_ERR_REMOTE_DISCONNECT;
    case TCPX_ERR_CLOSED: return NIXL_ERR_CANCELED;
    case TCPX_ERR_ACCESS:
    case TCPX_ERR_BUSY: return NIXL_ERR_NOT_ALLOWED;
    case TCPX_ERR_INCOMPATIBLE:
    case TCPX_ERR_ABI_MISMATCH: return NIXL_ERR_MISMATCH;
    default: return NIXL_ERR_BACKEND;
    }
}

Params Engine::options() {
    return {
        {"channels", ""},      // channels per connection (TCPX_NUM_CHANNELS); peers use the smaller
        {"chunk_bytes", ""},   // chunk size in bytes (TCPX_CHUNK_BYTES); peers use the smaller
        {"window", ""},        // requests in flight per comm, 1..16
        {"timeout_ms", ""},    // connection set-up and per-transfer timeout (TCPX_TIMEOUT_MS)
        {"plugin", ""},        // "auto", "builtin" or an ncclNet plugin path (TCPX_PLUGIN_PATH)
        {"control_addr", ""},  // control listener ip:port (TCPX_CONTROL_ADDR)
        {"gpu_index", ""},     // GPU index announced to peers (TCPX_GPU_INDEX)
        {"pin_engines", ""},   // 0 / 1: pin engine threads to NIC-local cores
        {"eager_bytes", ""},   // small two-sided messages in frames; off unless set (TCPX_EAGER_BYTES)
    };
}

Engine::Engine(const BackendInitParams *init_params) : BackendEngine(init_params) {
    try {
        init(init_params);
    } catch (const std::exception &e) {
        logError(std::string("engine for agent '") + localAgent + "' not created: " + e.what());
        initErr = true;
    } catch (...) {
        logError("engine not created: unknown exception");
        initErr = true;
    }
}

void Engine::init(const BackendInitParams *) {
    tcpx_status st = tcpx_init(TCPX_ABI_VERSION);
    if (st != TCPX_OK) throw std::runtime_error(failure("libtcpx ABI check", st));

    tcpx_endpoint_options o;
    tcpx_endpoint_options_init(&o);
    // NIXL moves data one-sided only (WRITE / READ, notifications on the control stream): eager
    // frames, which carry small two-sided messages, would only cost each connection its eager
    // comms and their frame buffers (about 2 MiB per channel and side) and a millisecond or two
    // of set-up, paid by the first transfer of every new agent pair (H100, 8 channels: that
    // transfer took 5.3-5.7 ms with them, 2.9 without). Off unless the user asks for them.
    if (std::getenv("TCPX_EAGER_BYTES") == nullptr) o.eager_bytes = 0;
    // Strings the options point into must outlive tcpx_endpoint_create.
    std::string plugin, control;
    for (const auto &[key, value] : getCustomParams()) {
        if (value.empty()) continue;  // unset: the environment or the default applies
        if (key == "channels") {
            o.channels = static_cast<uint32_t>(parseUnsigned(key, value, 1024));
        } else if (key == "chunk_bytes") {
            o.chunk_bytes = static_cast<uint32_t>(parseUnsigned(key, value, UINT32_MAX));
        } else if (key == "window") {
            o.window = static_cast<uint32_t>(parseUnsigned(key, value, 16));
        } else if (key == "timeout_ms") {
            o.timeout_ms = parseUnsigned(key, value, UINT32_MAX);
        } else if (key == "plugin") {
            plugin = value;
            o.backend = plugin.c_str();
        } else if (key == "control_addr") {
            control = value;
            o.control_addr = control.c_str();
        } else if (key == "gpu_index") {
            o.gpu_index = static_cast<int32_t>(parseUnsigned(key, value, INT32_MAX));
        } else if (key == "pin_engines") {
            o.pin_engines = static_cast<int32_t>(parseUnsigned(key, value, 1));
        } else if (key == "eager_bytes") {
            o.eager_bytes = static_cast<int64_t>(parseUnsigned(key, value, 65536));
        } else {
            logInfo("ignoring unknown backend parameter " + key);
        }
    }
    st = tcpx_endpoint_create(&o, &ep_);
    if (st != TCPX_OK) throw std::runtime_error(failure("tcpx_endpoint_create", st));

    tcpx_endpoint_info info;
    st = tcpx_endpoint_get_info(ep_, &info);
    if (st != TCPX_OK) throw std::runtime_error(failure("tcpx_endpoint_get_info", st));
    timeoutMs_ = info.timeout_ms > UINT32_MAX ? UINT32_MAX : static_cast<uint32_t>(info.timeout_ms);

    size_t len = TCPX_METADATA_MAX_BYTES;
    metadata_.resize(len);
    st = tcpx_endpoint_metadata(ep_, metadata_.data(), &len);
    if (st != TCPX_OK) throw std::runtime_error(failure("tcpx_endpoint_metadata", st));
    metadata_.resize(len);
    size_t llen = TCPX_LOCAL_INFO_MAX_BYTES;
    localInfo_.resize(llen);
    st = tcpx_endpoint_local_info(ep_, localInfo_.data(), &llen);
    if (st == TCPX_OK) {
        localInfo_.resize(llen);
    } else {
        logInfo(failure("no same-host route offered (tcpx_endpoint_local_info)", st));
        localInfo_.clear();
    }
    connInfo_ = wire::encodeConnInfo(metadata_, localInfo_);
    controlAddr_ = info.control_addr;
    if (localAgent.size() > wire::kMaxAgentName) {
        throw std::invalid_argument("agent name longer than 65535 bytes");
    }
    // Local (same-agent) transfers go through a connection to this endpoint itself, so DRAM
    // and VRAM take the same, tested path.
    peers_[localAgent].metadata = metadata_;
    notifBuf_.resize(4096);

    acceptor_ = std::thread([this] { acceptLoop(); });
    if (!localInfo_.empty()) localAcceptor_ = std::thread([this] { acceptLocalLoop(); });
    logInfo("agent '" + localAgent + "': endpoint " + info.control_addr + ", plugin " +
            info.plugin + ", " + std::to_string(info.channels) + " channels, chunk " +
            std::to_string(info.chunk_bytes) + " B, timeout " + std::to_string(info.timeout_ms) +
            " ms");
}

Engine::~Engine() {
    stop_ = true;
    // Ends the accept each thread is blocked in at once (not at its poll's end), so both
    // threads return now (or, when a peer is mid-set-up, within that set-up's timeout).
    if (ep_.id != 0) tcpx_endpoint_stop_accepting(ep_);
    if (acceptor_.joinable()) acceptor_.join();
    if (localAcceptor_.joinable()) localAcceptor_.join();
    if (ep_.id != 0) {
        // Destroying the endpoint closes its connections and releases its regions; it never
        // blocks longer than the connections' timeout.
        tcpx_endpoint_destroy(ep_);
    }
    for (auto &[key, md] : regs_) delete md;
}

namespace {
/// How long one accept (over the network or on this host) waits before its thread looks at
/// the notifications and failed connections again; a thread that wakes 200 times a second
/// costs a few microseconds of CPU each time. Destroying an agent does not wait for it: the
/// destructor stops the accepts (`tcpx_endpoint_stop_accepting`). Before that, destruction
/// waited for the running poll of both threads: 38–92 ms at 20 / 100 ms polls, 4–5 ms at 5
/// (median over 20 pairs; UCX 2–3 ms, issue 25).
constexpr uint32_t kAcceptPollMs = 5;
/// Accept polls between two sweeps for failed connections (every half second).
constexpr int kPrunePolls = 100;
}  // namespace

void Engine::acceptLoop() {
    for (int poll = 0; !stop_; poll++) {
        tcpx_connection conn{0};
        tcpx_peer_info peer;
        std::memset(&peer, 0, sizeof peer);
        const tcpx_status st = tcpx_endpoint_accept(ep_, kAcceptPollMs, &conn, &peer);
        if (st == TCPX_OK) {
            tcpx_connection stale{0};
            {
                std::lock_guard<std::mutex> lock(mu_);
                const std::string addr(peer.address);
                auto [it, inserted] = accepted_.try_emplace(addr, conn);
                if (!inserted) {
                    stale = it->second;  // the same address again: the old one is gone
                    it->second = conn;
                }
                tryBindLocked(addr);
            }
            if (stale.id != 0) tcpx_connection_destroy(stale);
            logInfo("agent '" + localAgent + "' accepted a connection from " + peer.address);
            flushWarm();
        } else if (st != TCPX_ERR_TIMEOUT && st != TCPX_PENDING) {
            if (stop_) break;
            logError(failure("accepting connections", st));
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        drainNotifications();
        if (poll % kPrunePolls == 0) pruneFailed(false);
    }
}

void Engine::acceptLocalLoop() {
    while (!stop_) {
        tcpx_local_connection conn{0};
        tcpx_local_peer_info peer;
        std::memset(&peer, 0, sizeof peer);
        const tcpx_status st = tcpx_endpoint_accept_local(ep_, kAcceptPollMs, &conn, &peer);
        if (st == TCPX_OK) {
            std::vector<tcpx_local_connection> dead;
            {
                std::lock_guard<std::mutex> lock(localMu_);
                // Peers that left: their ends go now rather than with the engine.
                for (auto it = acceptedLocal_.begin(); it != acceptedLocal_.end();) {
                    if (tcpx_local_connection_status(*it) != TCPX_OK) {
                        dead.push_back(*it);
                        it = acceptedLocal_.erase(it);
                    } else {
                        ++it;
                    }
                }
                acceptedLocal_.push_back(conn);
            }
            for (auto c : dead) tcpx_local_connection_destroy(c);
            logInfo("agent '" + localAgent + "' accepted a same-host connection from pid " +
                    std::to_string(peer.pid) + (peer.gpu_bus[0] ? std::string(" (GPU ") +
                    peer.gpu_bus + ")" : std::string()));
        } else if (st != TCPX_ERR_TIMEOUT && st != TCPX_PENDING) {
            if (stop_) break;
            logError(failure("accepting same-host connections", st));
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
    }
}

bool Engine::localConnection(const std::string &agent, tcpx_local_connection &out) const {
    std::vector<uint8_t> info;
    tcpx_local_connection dead{0};
    auto lookup = [&]() -> bool {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = peers_.find(agent);
        if (it == peers_.end() || !it->second.ipcRoute) return false;
        Peer &p = it->second;
        if (p.local.id != 0) {
            if (tcpx_local_connection_status(p.local) == TCPX_OK) {
                out = p.local;
                return true;
            }
            dead = p.local;  // the peer left: dial again below
            p.local = tcpx_local_connection{0};
        }
        info = p.localInfo;
        return false;
    };
    if (lookup()) return true;
    if (dead.id != 0) tcpx_local_connection_destroy(dead);
    dead = tcpx_local_connection{0};
    if (info.empty()) return false;

    std::lock_guard<std::mutex> dial(dialMu_);
    if (lookup()) return true;
    if (dead.id != 0) tcpx_local_connection_destroy(dead);
    if (info.empty()) return false;
    tcpx_local_connection conn{0};
    const tcpx_status st = tcpx_endpoint_connect_local(ep_, info.data(), info.size(), &conn);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(agent);
    if (st != TCPX_OK || it == peers_.end()) {
        if (st == TCPX_OK) tcpx_local_connection_destroy(conn);
        if (it != peers_.end()) it->second.ipcRoute = false;
        logInfo(failure("agent '" + localAgent + "': no same-host connection to agent '" + agent +
                            "', using the network",
                        st));
        return false;
    }
    it->second.local = conn;
    out = conn;
    logInfo("agent '" + localAgent + "' reaches agent '" + agent + "' through CUDA IPC");
    return true;
}

void Engine::forgetLocal(const std::string &agent, tcpx_local_connection conn) const {
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = peers_.find(agent);
        if (it == peers_.end() || it->second.local.id != conn.id) return;
        it->second.local = tcpx_local_connection{0};
    }
    tcpx_local_connection_destroy(conn);
}

void Engine::tryBindLocked(const std::string &addr) const {
    auto a = accepted_.find(addr);
    auto h = helloFrom_.find(addr);
    if (a == accepted_.end() || h == helloFrom_.end()) return;
    const Hello hello = h->second;
    Peer &p = peers_[hello.agent];
    const tcpx_connection conn = a->second;
    logInfo("agent '" + localAgent + "': connection from " + addr + " is agent '" + hello.agent +
            "'" + (hello.endpoint.empty() ? "" : " at " + hello.endpoint));
    accepted_.erase(a);
    helloFrom_.erase(h);
    if (p.conn.id != 0) {
        // Keep sending where this side sent so far (its notifications stay ordered behind its
        // writes) unless that connection failed, or the name now belongs to another endpoint:
        // an agent replaced under the same name (restarted, re-created) introduces itself from
        // a new endpoint, and the old one is gone or going.
        const bool failed = tcpx_connection_status(p.conn) != TCPX_OK;
        const bool moved =
            !hello.endpoint.empty() && !p.endpoint.empty() && hello.endpoint != p.endpoint;
        if (failed || moved) {
            if (moved) {
                logInfo("agent '" + localAgent + "': agent '" + hello.agent + "' moved from " +
                        p.endpoint + " to " + hello.endpoint + "; sending there from now on");
            }
            p.others.push_back(p.conn);  // closed at disconnect, or pruned once failed
            p.conn = tcpx_connection{0};
            p.endpoint.clear();
        }
    }
    if (p.conn.id == 0) {
        p.conn = conn;
        p.endpoint = hello.endpoint;
    } else {
        p.others.push_back(conn);  // a simultaneous dial of the same endpoint
    }
    toWarm_.push_back(conn);
}

void Engine::pruneFailed(bool current) const {
    std::vector<tcpx_connection> dead;
    {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto &[name, p] : peers_) {
            if (current && p.conn.id != 0 && tcpx_connection_status(p.conn) != TCPX_OK) {
                dead.push_back(p.conn);  // the next send to this agent dials afresh
                p.conn = tcpx_connection{0};
                p.endpoint.clear();
            }
            auto &o = p.others;
            for (auto it = o.begin(); it != o.end();) {
                if (tcpx_connection_status(*it) != TCPX_OK) {
                    dead.push_back(*it);
                    it = o.erase(it);
                } else {
                    ++it;
                }
            }
        }
        // Accepted, never named (the peer left before its Hello arrived).
        for (auto it = accepted_.begin(); it != accepted_.end();) {
            if (tcpx_connection_status(it->second) != TCPX_OK) {
                dead.push_back(it->second);
                it = accepted_.erase(it);
            } else {
                ++it;
            }
        }
    }
    for (auto c : dead) tcpx_connection_destroy(c);
    if (!dead.empty()) {
        logDebug("agent '" + localAgent + "' closed " + std::to_string(dead.size()) +
                 " failed connection(s)");
    }
}

std::shared_ptr<std::mutex> Engine::dialLock(const std::string &agent) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto &l = dialLocks_[agent];
    if (!l) l = std::make_shared<std::mutex>();
    return l;
}

void Engine::warmUp(tcpx_connection conn, const std::vector<tcpx_region> &regions) const {
    if (regions.empty()) return;
    const auto started = std::chrono::steady_clock::now();
    size_t done = 0;
    for (const tcpx_region r : regions) {
        // One at a time: a region deregistered meanwhile fails alone.
        const tcpx_status st = tcpx_connection_warmup(conn, &r, 1);
        if (st == TCPX_OK) {
            done++;
        } else {
            logDebug(failure("agent '" + localAgent + "' warming up a connection", st));
        }
    }
    const double ms = std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - started)
                          .count();
    logDebug("agent '" + localAgent + "' registered " + std::to_string(done) + " of " +
             std::to_string(regions.size()) + " region(s) on a connection ahead of its first "
             "transfer (" + std::to_string(ms) + " ms)");
}

void Engine::flushWarm() const {
    std::vector<tcpx_connection> conns;
    {
        std::lock_guard<std::mutex> lock(mu_);
        conns.swap(toWarm_);
    }
    if (conns.empty()) return;
    std::vector<tcpx_region> regions;
    {
        std::lock_guard<std::mutex> lock(regMu_);
        for (const auto &[key, md] : regs_) regions.push_back(md->region);
    }
    for (auto c : conns) warmUp(c, regions);
}

void Engine::drainNotifications() const {
    {
        std::lock_guard<std::mutex> lock(notifMu_);
        drainLocked();
    }
    flushWarm();  // connections a Hello just bound
}

void Engine::drainLocked() const {
    for (;;) {
        tcpx_notification info;
        std::memset(&info, 0, sizeof info);
        const tcpx_status st =
            tcpx_endpoint_notification(ep_, 0, &info, notifBuf_.data(), notifBuf_.size());
        if (st == TCPX_ERR_BUFFER_TOO_SMALL) {
            notifBuf_.resize(info.len);
            continue;
        }
        if (st == TCPX_PENDING) return;
        if (st != TCPX_OK) {
            logError(failure("taking notifications", st));
            return;
        }
        const std::string payload(reinterpret_cast<const char *>(notifBuf_.data()), info.len);
        auto n = wire::decodeNotif(payload);
        if (!n) {
            logError(std::string("dropped a notification from ") + info.peer +
                     " that is not in this plugin's format (" + std::to_string(info.len) +
                     " bytes: " + wire::lastDecodeError() + ")");
            continue;
        }
        logDebug("agent '" + localAgent + "': notification from " + info.peer + " (agent '" +
                 n->agent + "', " + (n->kind == wire::NotifKind::Hello ? "hello" : "user") +
                 ", " + std::to_string(info.len) + " bytes)");
        if (n->kind == wire::NotifKind::Hello) {
            std::lock_guard<std::mutex> peers(mu_);
            helloFrom_[info.peer] = Hello{n->agent, n->msg};
            tryBindLocked(info.peer);
        } else {
            notifs_.emplace_back(std::move(n->agent), std::move(n->msg));
        }
    }
}

Status Engine::connection(const std::string &agent, tcpx_connection &out) const {
    std::vector<tcpx_connection> dead;
    auto lookup = [&]() -> bool {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = peers_.find(agent);
        if (it == peers_.end() || it->second.conn.id == 0) return false;
        if (tcpx_connection_status(it->second.conn) == TCPX_OK) {
            out = it->second.conn;
            return true;
        }
        // Failed (peer gone, timeout): dial a new one below.
        dead.push_back(it->second.conn);
        it->second.conn = tcpx_connection{0};
        return false;
    };
    auto closeDead = [&] {
        for (auto c : dead) tcpx_connection_destroy(c);
        dead.clear();
    };
    if (lookup()) return NIXL_SUCCESS;
    closeDead();
    drainNotifications();  // a pending Hello may name an accepted connection to this agent
    if (lookup()) return NIXL_SUCCESS;
    closeDead();

    const auto dialing = dialLock(agent);
    std::lock_guard<std::mutex> dial(*dialing);
    std::vector<uint8_t> md;
    {
        if (lookup()) return NIXL_SUCCESS;
        std::lock_guard<std::mutex> lock(mu_);
        auto it = peers_.find(agent);
        if (it != peers_.end()) md = it->second.metadata;
    }
    closeDead();
    if (md.empty()) {
        logError("agent '" + localAgent + "' has no TCPX connection info for agent '" + agent +
                 "': load its metadata first");
        return NIXL_ERR_NOT_FOUND;
    }
    tcpx_connection conn{0};
    logDebug("agent '" + localAgent + "' dialing agent '" + agent + "'");
    // Bounded: a refused dial fails at once, an unanswered one after the endpoint's timeout.
    tcpx_status st = tcpx_endpoint_connect(ep_, md.data(), md.size(), &conn);
    if (st != TCPX_OK) {
        logError(failure("agent '" + localAgent + "' connecting to agent '" + agent + "'", st));
        return toNixl(st);
    }
    // The Hello names this agent and its endpoint, so that the other side can tell a
    // simultaneous dial of the same agent from an agent replaced under the same name.
    const std::string hello = wire::encodeNotif(wire::NotifKind::Hello, localAgent, controlAddr_);
    st = tcpx_connection_notify(conn, reinterpret_cast<const uint8_t *>(hello.data()),
                                hello.size());
    if (st != TCPX_OK) {
        logError(failure("introducing agent '" + localAgent + "' to agent '" + agent + "'", st));
        tcpx_connection_destroy(conn);
        return toNixl(st);
    }
    tcpx_peer_info where;
    std::memset(&where, 0, sizeof where);
    tcpx_connection_peer(conn, &where);
    bool mine = false;
    {
        std::lock_guard<std::mutex> lock(mu_);
        Peer &p = peers_[agent];
        if (p.conn.id != 0) {
            p.others.push_back(conn);  // the peer's own dial was bound meanwhile: send on it
        } else {
            p.conn = conn;
            p.endpoint = where.address;
            mine = true;
        }
        out = p.conn;
    }
    logInfo("agent '" + localAgent + "' connected to agent '" + agent + "' at " + where.address);
    if (mine) {
        std::vector<tcpx_region> regions;
        {
            std::lock_guard<std::mutex> lock(regMu_);
            for (const auto &[key, m] : regs_) regions.push_back(m->region);
        }
        warmUp(conn, regions);
    }
    flushWarm();
    return NIXL_SUCCESS;
}

void Engine::forget(const std::string &agent, tcpx_connection conn) const {
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = peers_.find(agent);
        if (it == peers_.end() || it->second.conn.id != conn.id) return;
        it->second.conn = tcpx_connection{0};
    }
    tcpx_connection_destroy(conn);
}

namespace {
/// A submit failure that means the connection is gone (the peer closed it, or it was closed
/// here), not that the request was bad: worth one retry on a fresh connection.
bool connectionGone(tcpx_status s) {
    return s == TCPX_ERR_PEER_CLOSED || s == TCPX_ERR_CLOSED || s == TCPX_ERR_STALE_HANDLE;
}
}  // namespace

Status Engine::connect(const std::string &remote_agent) {
    return guarded("connect", [&] {
        // NIXL connects every engine to its own agent at creation; that connection is made
        // at the first local transfer instead, so agents that never use it do not pay for it.
        if (remote_agent == localAgent) return NIXL_SUCCESS;
        tcpx_connection conn{0};
        return connection(remote_agent, conn);
    });
}

Status Engine::disconnect(const std::string &remote_agent) {
    return guarded("disconnect", [&] {
        std::vector<tcpx_connection> close;
        tcpx_local_connection local{0};
        {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = peers_.find(remote_agent);
            if (it == peers_.end()) return NIXL_SUCCESS;
            local = it->second.local;
            it->second.local = tcpx_local_connection{0};
            if (it->second.conn.id != 0) close.push_back(it->second.conn);
            close.insert(close.end(), it->second.others.begin(), it->second.others.end());
            if (remote_agent == localAgent) {
                it->second.conn = tcpx_connection{0};
                it->second.endpoint.clear();
                it->second.others.clear();
            } else {
                peers_.erase(it);
                dialLocks_.erase(remote_agent);
            }
        }
        for (auto c : close) tcpx_connection_destroy(c);
        if (local.id != 0) tcpx_local_connection_destroy(local);
        logInfo("agent '" + localAgent + "' disconnected from agent '" + remote_agent + "'");
        return NIXL_SUCCESS;
    });
}

Status Engine::loadRemoteConnInfo(const std::string &remote_agent, const std::string &info) {
    return guarded("loadRemoteConnInfo", [&] {
        auto ci = wire::decodeConnInfo(info);
        if (!ci) {
            logError("connection info of agent '" + remote_agent + "' (" +
                     std::to_string(info.size()) + " bytes) is not a TCPX backend's: " +
                    wire::lastDecodeError());
            return NIXL_ERR_INVALID_PARAM;
        }
        if (remote_agent.empty() || remote_agent.size() > wire::kMaxAgentName) {
            logError("agent name of " + std::to_string(remote_agent.size()) + " bytes");
            return NIXL_ERR_INVALID_PARAM;
        }
        // Same-host route: asked once per load (tcpx compares boot ids, users, GPUs).
        bool ipc = false;
        logDebug("agent '" + localAgent + "' loading the connection info of agent '" +
                 remote_agent + "'");
        if (!ci->local.empty()) {
            char why[256] = {0};
            const tcpx_status rs = tcpx_endpoint_local_route(ep_, ci->local.data(),
                                                             ci->local.size(), &ipc, why,
                                                             sizeof why);
            if (rs != TCPX_OK) {
                ipc = false;
                logInfo(failure("same-host info of agent '" + remote_agent + "'", rs));
            } else {
                logInfo("agent '" + localAgent + "' -> agent '" + remote_agent + "': " +
                        (ipc ? std::string("CUDA IPC for VRAM") : std::string("network (") + why +
                         ")"));
            }
        }
        tcpx_local_connection retiredLocal{0};
        {
        std::lock_guard<std::mutex> lock(mu_);
        Peer &p = peers_[remote_agent];
        if (!p.metadata.empty() && p.metadata != ci->metadata && p.local.id != 0) {
            // A same-host connection to the replaced instance is useless to the new one.
            retiredLocal = p.local;
            p.local = tcpx_local_connection{0};
        }
        if (!p.metadata.empty() && p.metadata != ci->metadata && p.conn.id != 0) {
            // Other connection info under a known name: the agent was replaced. Its next
            // send dials the new endpoint (unless the new one introduces itself first).
            logInfo("agent '" + localAgent + "': agent '" + remote_agent +
                    "' has new connection info; the connection to its old endpoint is retired");
            p.others.push_back(p.conn);
            p.conn = tcpx_connection{0};
            p.endpoint.clear();
        }
        p.metadata = std::move(ci->metadata);
        p.localInfo = std::move(ci->local);
        p.ipcRoute = ipc;
        }
        if (retiredLocal.id != 0) tcpx_local_connection_destroy(retiredLocal);
        return NIXL_SUCCESS;
    });
}

Status Engine::getConnInfo(std::string &str) const {
    return guarded("getConnInfo", [&] {
        str = connInfo_;
        return NIXL_SUCCESS;
    });
}

Status Engine::registerMem(const BlobDesc &mem, const MemType &type, BackendMD *&out) {
    return guarded("registerMem", [&] {
        if (!isMemory(type)) {
            logError("registerMem: memory type " + std::to_string(type) +
                     " is not DRAM_SEG or VRAM_SEG");
            return NIXL_ERR_NOT_SUPPORTED;
        }
        if (mem.addr == 0 || mem.len == 0) {
            logError("registerMem: empty range (address " + std::to_string(mem.addr) +
                     ", length " + std::to_string(mem.len) + ")");
            return NIXL_ERR_INVALID_PARAM;
        }
        tcpx_region region{0};
        {
            std::lock_guard<std::mutex> lock(regMu_);
            const Status st = registerLocked(mem, type, out, region);
            if (st != NIXL_SUCCESS || region.id == 0) return st;
        }
        // A new region on connections that exist already: registered on them now rather than
        // at its first transfer there.
        std::vector<tcpx_connection> conns;
        {
            std::lock_guard<std::mutex> lock(mu_);
            for (const auto &[name, p] : peers_) {
                if (p.conn.id != 0) conns.push_back(p.conn);
            }
        }
        for (auto c : conns) warmUp(c, {region});
        return NIXL_SUCCESS;
    });
}

Status Engine::registerLocked(const BlobDesc &mem, const MemType &type, BackendMD *&out,
                              tcpx_region &created) {
    {
        const auto key = std::make_pair(mem.addr, mem.len);
        if (auto it = regs_.find(key); it != regs_.end()) {
            it->second->refs++;
            out = it->second;
            return NIXL_SUCCESS;
        }
        auto md = std::make_unique<LocalMD>();
        md->type = type;
        md->base = mem.addr;
        md->len = mem.len;
        if (type == VRAM_SEG) md->gpu = static_cast<int>(mem.devId);
        tcpx_status st = tcpx_endpoint_register(ep_, reinterpret_cast<void *>(mem.addr), mem.len,
                                                &md->region);
        if (st != TCPX_OK) {
            logError(failure("registering " + std::to_string(mem.len) + " bytes at " +
                                 std::to_string(mem.addr),
                             st));
            return toNixl(st);
        }
        st = tcpx_region_advertise(md->region, md->descriptor, sizeof md->descriptor);
        if (st != TCPX_OK) {
            logError(failure("advertising a registered range", st));
            tcpx_region_destroy(md->region);
            return toNixl(st);
        }
        if (type == VRAM_SEG && !localInfo_.empty()) {
            // For peers of this host (CUDA IPC); memory the driver cannot export (cuMemCreate,
            // pools) is served over the network only.
            st = tcpx_region_advertise_ipc(md->region, 0, mem.len, md->ipcDescriptor,
                                           sizeof md->ipcDescriptor);
            md->hasIpc = st == TCPX_OK;
            if (!md->hasIpc) logInfo(failure("VRAM not exported for same-host peers", st));
        }
        regs_.emplace(key, md.get());
        created = md->region;
        out = md.release();
        return NIXL_SUCCESS;
    }
}

Status Engine::deregisterMem(BackendMD *meta) {
    return guarded("deregisterMem", [&] {
        auto *md = static_cast<MD *>(meta);
        if (!md || !md->isRegistration()) return NIXL_ERR_INVALID_PARAM;
        auto *local = static_cast<LocalMD *>(md);
        {
            std::lock_guard<std::mutex> lock(regMu_);
            if (--local->refs > 0) return NIXL_SUCCESS;
            regs_.erase(std::make_pair(local->base, local->len));
        }
        // Busy while a transfer on it (this side's, or a peer's one-sided operation being
        // served) still runs: the first destroy revoked it, so no new one starts, and the
        // running ones finish or fail within the timeout. The caller frees the memory once
        // this returns, so wait for them (bounded) rather than leave them writing into it.
        const auto deadline =
            std::chrono::steady_clock::now() + std::chrono::milliseconds(timeoutMs_);
        tcpx_status st = tcpx_region_destroy(local->region);
        if (st == TCPX_ERR_BUSY) {
            // A failed transfer's requests stay with the plugin until its connection is
            // destroyed: failed connections serve nothing any more, so close them now.
            pruneFailed(true);
            st = tcpx_region_destroy(local->region);
        }
        while (st == TCPX_ERR_BUSY && std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
            st = tcpx_region_destroy(local->region);
        }
        delete local;
        if (st != TCPX_OK) {
            // Still busy after the timeout: the region stays revoked and is released with the
            // endpoint.
            logError(failure("deregistering memory", st));
            return toNixl(st);
        }
        return NIXL_SUCCESS;
    });
}

Status Engine::getPublicData(const BackendMD *meta, std::string &str) const {
    return guarded("getPublicData", [&] {
        const auto *md = static_cast<const MD *>(meta);
        if (!md || !md->isRegistration()) return NIXL_ERR_INVALID_PARAM;
        const auto *local = static_cast<const LocalMD *>(md);
        wire::PublicMem pm;
        pm.memType = static_cast<uint32_t>(local->type);
        pm.base = local->base;
        pm.len = local->len;
        std::memcpy(pm.descriptor, local->descriptor, sizeof pm.descriptor);
        pm.hasIpc = local->hasIpc;
        std::memcpy(pm.ipcDescriptor, local->ipcDescriptor, sizeof pm.ipcDescriptor);
        str = wire::encodePublicMem(pm);
        return NIXL_SUCCESS;
    });
}

Status Engine::loadRemoteMD(const BlobDesc &input, const MemType &type,
                            const std::string &remote_agent, BackendMD *&output) {
    return guarded("loadRemoteMD", [&] {
        auto pm = wire::decodePublicMem(input.metaInfo);
        if (!pm) {
            logError("metadata of agent '" + remote_agent + "' for " +
                     std::to_string(input.len) + " bytes at " + std::to_string(input.addr) +
                     " is not a TCPX backend's (" + std::to_string(input.metaInfo.size()) +
                     " bytes: " + wire::lastDecodeError() + ")");
            return NIXL_ERR_INVALID_PARAM;
        }
        if (pm->memType != static_cast<uint32_t>(type) || !isMemory(type) ||
            pm->base != input.addr || pm->len != input.len) {
            logError("metadata of agent '" + remote_agent + "' describes another range or "
                     "memory type than its descriptor");
            return NIXL_ERR_MISMATCH;
        }
        auto md = std::make_unique<RemoteMD>();
        md->agent = remote_agent;
        md->type = type;
        md->base = pm->base;
        md->len = pm->len;
        std::memcpy(md->descriptor, pm->descriptor, sizeof md->descriptor);
        md->hasIpc = pm->hasIpc;
        std::memcpy(md->ipcDescriptor, pm->ipcDescriptor, sizeof md->ipcDescriptor);
        // The metadata exchange is where a new agent pair spends ~150 ms anyway: the first
        // transfer's CUDA IPC set-up (0.6 ms, 20 x the tenth) is paid here instead.
        if (md->hasIpc && type == VRAM_SEG) prepareIpc(remote_agent, md->ipcDescriptor);
        output = md.release();
        return NIXL_SUCCESS;
    });
}

void Engine::prepareIpc(const std::string &agent, const uint8_t *ipcDescriptor) const {
    tcpx_local_connection lc{0};
    if (!localConnection(agent, lc)) return;
    std::vector<int> gpus;
    {
        std::lock_guard<std::mutex> lock(regMu_);
        for (const auto &[key, md] : regs_) {
            if (md->type == VRAM_SEG &&
                std::find(gpus.begin(), gpus.end(), md->gpu) == gpus.end()) {
                gpus.push_back(md->gpu);
            }
        }
    }
    if (gpus.empty()) gpus.push_back(-1);  // the endpoint's GPU
    for (const int gpu : gpus) {
        const tcpx_status st = tcpx_local_connection_prepare_ipc(
            lc, ipcDescriptor, TCPX_IPC_DESCRIPTOR_BYTES, gpu);
        if (st != TCPX_OK) {
            logDebug(failure("agent '" + localAgent + "': preparing CUDA IPC to agent '" +
                                 agent + "' on GPU " + std::to_string(gpu),
                             st));
        }
    }
}

Status Engine::loadLocalMD(BackendMD *input, BackendMD *&output) {
    return guarded("loadLocalMD", [&] {
        auto *md = static_cast<MD *>(input);
        if (!md || !md->isRegistration()) return NIXL_ERR_INVALID_PARAM;
        const auto *local = static_cast<const LocalMD *>(md);
        auto view = std::make_unique<RemoteMD>();
        view->agent = localAgent;
        view->type = local->type;
        view->base = local->base;
        view->len = local->len;
        std::memcpy(view->descriptor, local->descriptor, sizeof view->descriptor);
        view->hasIpc = local->hasIpc;
        std::memcpy(view->ipcDescriptor, local->ipcDescriptor, sizeof view->ipcDescriptor);
        output = view.release();
        return NIXL_SUCCESS;
    });
}

Status Engine::unloadMD(BackendMD *input) {
    return guarded("unloadMD", [&] {
        auto *md = static_cast<MD *>(input);
        if (!md) return NIXL_SUCCESS;
        if (md->isRegistration()) {
            logError("unloadMD got a registration; deregisterMem releases those");
            return NIXL_ERR_INVALID_PARAM;
        }
        delete static_cast<RemoteMD *>(md);
        return NIXL_SUCCESS;
    });
}

Status Engine::buildRequest(const XferOp &op, const MetaDescList &local,
                            const MetaDescList &remote, const std::string &agent,
                            Request &req) const {
    if (op != NIXL_READ && op != NIXL_WRITE) {
        logError("unknown transfer operation " + std::to_string(op));
        return NIXL_ERR_INVALID_PARAM;
    }
    if (!isMemory(local.getType()) || !isMemory(remote.getType())) {
        logError("transfer between memory types " + std::to_string(local.getType()) + " and " +
                 std::to_string(remote.getType()) + ": only DRAM_SEG and VRAM_SEG");
        return NIXL_ERR_NOT_SUPPORTED;
    }
    if (local.isEmpty() || remote.isEmpty()) {
        logError("transfer with an empty descriptor list");
        return NIXL_ERR_INVALID_PARAM;
    }
    req.op = op;
    req.agent = agent;
    req.local.clear();
    req.remote.clear();
    req.local.reserve(local.descCount());
    req.remote.reserve(remote.descCount());
    uint64_t localTotal = 0, remoteTotal = 0;
    for (int i = 0; i < local.descCount(); i++) {
        const MetaDesc &d = local[i];
        const auto *md = static_cast<const MD *>(d.metadataP);
        if (!md || !md->isRegistration()) {
            logError("local descriptor " + std::to_string(i) + " has no TCPX registration");
            return NIXL_ERR_INVALID_PARAM;
        }
        const auto *reg = static_cast<const LocalMD *>(md);
        if (d.addr < reg->base || d.len > reg->len || d.addr - reg->base > reg->len - d.len) {
            logError("local descriptor " + std::to_string(i) + " lies outside its registration");
            return NIXL_ERR_INVALID_PARAM;
        }
        if (d.len == 0) continue;
        const uint64_t off = d.addr - reg->base;
        localTotal += d.len;
        if (!req.local.empty()) {
            tcpx_segment &last = req.local.back();
            if (last.region.id == reg->region.id && last.offset + last.len == off) {
                last.len += d.len;  // contiguous with the previous block: one segment
                continue;
            }
        }
        req.local.push_back(tcpx_segment{reg->region, off, d.len});
    }
    const RemoteMD *lastRemote = nullptr;
    for (int i = 0; i < remote.descCount(); i++) {
        const MetaDesc &d = remote[i];
        const auto *md = static_cast<const MD *>(d.metadataP);
        if (!md || md->isRegistration()) {
            logError("remote descriptor " + std::to_string(i) + " has no loaded TCPX metadata");
            return NIXL_ERR_INVALID_PARAM;
        }
        const auto *r = static_cast<const RemoteMD *>(md);
        if (r->agent != agent) {
            logError("remote descriptor " + std::to_string(i) + " belongs to agent '" + r->agent +
                     "', not '" + agent + "'");
            return NIXL_ERR_INVALID_PARAM;
        }
        if (d.addr < r->base || d.len > r->len || d.addr - r->base > r->len - d.len) {
            logError("remote descriptor " + std::to_string(i) + " lies outside agent '" + agent +
                     "''s registration");
            return NIXL_ERR_INVALID_PARAM;
        }
        if (d.len == 0) continue;
        const uint64_t off = d.addr - r->base;
        remoteTotal += d.len;
        if (!req.remote.empty() && lastRemote == r) {
            tcpx_remote_segment &last = req.remote.back();
            if (last.offset + last.len == off) {
                last.len += d.len;
                continue;
            }
        }
        tcpx_remote_segment seg;
        std::memcpy(seg.descriptor, r->descriptor, sizeof seg.descriptor);
        seg.offset = off;
        seg.len = d.len;
        req.remote.push_back(seg);
        lastRemote = r;
    }
    if (localTotal != remoteTotal || localTotal == 0) {
        logError("local list holds " + std::to_string(localTotal) + " bytes, remote list " +
                 std::to_string(remoteTotal));
        return NIXL_ERR_MISMATCH;
    }
    buildIpc(local, remote, req);
    return NIXL_SUCCESS;
}

void Engine::buildIpc(const MetaDescList &local, const MetaDescList &remote, Request &req) const {
    req.ipc.clear();
    if (local.getType() != VRAM_SEG || remote.getType() != VRAM_SEG ||
        local.descCount() != remote.descCount()) {
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = peers_.find(req.agent);
        if (it == peers_.end() || !it->second.ipcRoute) return;
    }
    // Pairs (local[i], remote[i]) of equal length (buildRequest checked both lie inside their
    // registrations); neighbours contiguous on both sides merge.
    const RemoteMD *lastRemote = nullptr;
    for (int i = 0; i < local.descCount(); i++) {
        const MetaDesc &ld = local[i];
        const MetaDesc &rd = remote[i];
        const auto *reg = static_cast<const LocalMD *>(static_cast<const MD *>(ld.metadataP));
        const auto *r = static_cast<const RemoteMD *>(static_cast<const MD *>(rd.metadataP));
        if (ld.len != rd.len || !r->hasIpc) {
            req.ipc.clear();
            return;
        }
        if (ld.len == 0) continue;
        const uint64_t loff = ld.addr - reg->base;
        const uint64_t roff = rd.addr - r->base;
        if (!req.ipc.empty() && lastRemote == r) {
            tcpx_ipc_segment &last = req.ipc.back();
            if (last.region.id == reg->region.id && last.offset + last.len == loff &&
                last.remote_offset + last.len == roff) {
                last.len += ld.len;
                continue;
            }
        }
        tcpx_ipc_segment seg;
        seg.region = reg->region;
        seg.offset = loff;
        std::memcpy(seg.descriptor, r->ipcDescriptor, sizeof seg.descriptor);
        seg.remote_offset = roff;
        seg.len = ld.len;
        req.ipc.push_back(seg);
        lastRemote = r;
    }
}

Status Engine::prepXfer(const XferOp &op, const MetaDescList &local, const MetaDescList &remote,
                        const std::string &remote_agent, BackendReqH *&handle,
                        const BackendOptionalArgs *) const {
    return guarded("prepXfer", [&] {
        auto req = std::make_unique<Request>();
        const Status st = buildRequest(op, local, remote, remote_agent, *req);
        if (st != NIXL_SUCCESS) return st;
        handle = req.release();
        return NIXL_SUCCESS;
    });
}

Status Engine::startTransfer(Request &req, const BackendOptionalArgs *opt) const {
    const bool notify = opt && opt->hasNotif;
    std::string payload;
    if (notify) {
        if (opt->notifMsg.size() + wire::notifOverhead(localAgent) > TCPX_NOTIFICATION_MAX_BYTES) {
            logError("notification of " + std::to_string(opt->notifMsg.size()) +
                     " bytes exceeds the limit");
            return NIXL_ERR_INVALID_PARAM;
        }
        payload = wire::encodeNotif(wire::NotifKind::User, localAgent, opt->notifMsg);
    }
    tcpx_status st = TCPX_OK;
    req.viaIpc = false;
    if (!req.ipc.empty()) {
        const Status is = startIpc(req, notify, payload);
        if (is != NIXL_ERR_NOT_SUPPORTED) return is;  // else: no local connection, network
    }
    for (int attempt = 0; attempt < 2; attempt++) {
        tcpx_connection conn{0};
        Status ns = connection(req.agent, conn);
        if (ns != NIXL_SUCCESS) return ns;
        req.conn = conn;
        req.failed = false;
        req.notifPending = false;
        if (req.op == NIXL_WRITE) {
            // The notification travels with the write and is delivered after its bytes landed.
            st = tcpx_connection_write(
                conn, req.local.data(), req.local.size(), req.remote.data(), req.remote.size(),
                notify ? reinterpret_cast<const uint8_t *>(payload.data()) : nullptr,
                payload.size(), &req.xfer);
        } else {
            st = tcpx_connection_read(conn, req.local.data(), req.local.size(), req.remote.data(),
                                      req.remote.size(), &req.xfer);
            if (notify && st == TCPX_OK) {
                req.pendingNotif = payload;  // sent once the read completed
                req.notifPending = true;
            }
        }
        if (!connectionGone(st)) break;
        forget(req.agent, conn);  // closed under us (the peer disconnected): dial again
    }
    if (st != TCPX_OK) {
        req.xfer = tcpx_transfer{0};
        req.notifPending = false;
        logError(failure(std::string(req.op == NIXL_WRITE ? "WRITE" : "READ") + " to agent '" +
                             req.agent + "'",
                         st));
        return toNixl(st);
    }
    return NIXL_IN_PROG;
}

Status Engine::startIpc(Request &req, bool notify, const std::string &payload) const {
    tcpx_status st = TCPX_OK;
    for (int attempt = 0; attempt < 2; attempt++) {
        tcpx_local_connection lc{0};
        if (!localConnection(req.agent, lc)) return NIXL_ERR_NOT_SUPPORTED;
        if (notify) {
            // The notification follows over the network once the copies completed.
            tcpx_connection conn{0};
            const Status ns = connection(req.agent, conn);
            if (ns != NIXL_SUCCESS) return ns;
            req.conn = conn;
        }
        req.failed = false;
        req.notifPending = false;
        st = req.op == NIXL_WRITE
                 ? tcpx_local_connection_write_ipc(lc, req.ipc.data(), req.ipc.size(), &req.xfer)
                 : tcpx_local_connection_read_ipc(lc, req.ipc.data(), req.ipc.size(), &req.xfer);
        if (st == TCPX_OK) {
            req.viaIpc = true;
            if (notify) {
                req.pendingNotif = payload;
                req.notifPending = true;
            }
            return NIXL_IN_PROG;
        }
        if (!connectionGone(st)) break;
        forgetLocal(req.agent, lc);  // the peer left or closed it: dial again
    }
    req.xfer = tcpx_transfer{0};
    logError(failure(std::string(req.op == NIXL_WRITE ? "WRITE" : "READ") + " to agent '" +
                         req.agent + "' through CUDA IPC",
                     st));
    return toNixl(st);
}

Status Engine::postXfer(const XferOp &op, const MetaDescList &local, const MetaDescList &remote,
                        const std::string &remote_agent, BackendReqH *&handle,
                        const BackendOptionalArgs *opt_args) const {
    return guarded("postXfer", [&] {
        if (!handle) {
            const Status st = prepXfer(op, local, remote, remote_agent, handle, opt_args);
            if (st != NIXL_SUCCESS) return st;
        }
        auto *req = static_cast<Request *>(handle);
        if (req->xfer.id != 0) {
            // Reposting a finished request: release the previous tcpx transfer first.
            if (tcpx_transfer_test(req->xfer, nullptr) == TCPX_PENDING) {
                return NIXL_ERR_REPOST_ACTIVE;
            }
            tcpx_transfer_release(req->xfer);
            req->xfer = tcpx_transfer{0};
        }
        return startTransfer(*req, opt_args);
    });
}

Status Engine::checkXfer(BackendReqH *handle) const {
    return guarded("checkXfer", [&] {
        auto *req = static_cast<Request *>(handle);
        if (!req || req->xfer.id == 0) return NIXL_ERR_NOT_POSTED;
        if (req->failed) return NIXL_ERR_BACKEND;
        const tcpx_status st = tcpx_transfer_test(req->xfer, nullptr);
        if (st == TCPX_PENDING) {
            // NIXL applications poll checkXfer in a tight loop. The transfer progresses on
            // tcpx's engine and control threads; when one of them waits for the core this
            // poller holds, every hand-off would wait out a scheduler slice (4 ms measured on
            // a loaded 2-core host). Giving the core away once per poll lets them run.
            std::this_thread::yield();
            return NIXL_IN_PROG;
        }
        if (st != TCPX_OK) {
            req->failed = true;
            logError(failure(std::string(req->op == NIXL_WRITE ? "WRITE" : "READ") +
                                 " to agent '" + req->agent + "'",
                             st));
            return toNixl(st);
        }
        if (req->notifPending) {
            req->notifPending = false;
            const tcpx_status ns = tcpx_connection_notify(
                req->conn, reinterpret_cast<const uint8_t *>(req->pendingNotif.data()),
                req->pendingNotif.size());
            if (ns != TCPX_OK) {
                req->failed = true;
                logError(failure("notification after a READ from agent '" + req->agent + "'",
                                 ns));
                return toNixl(ns);
            }
        }
        return NIXL_SUCCESS;
    });
}

Status Engine::releaseReqH(BackendReqH *handle) const {
    return guarded("releaseReqH", [&] {
        auto *req = static_cast<Request *>(handle);
        if (!req) return NIXL_SUCCESS;
        // tcpx does not cancel: an unfinished transfer runs on (or fails with its connection);
        // NIXL keeps the memory registered until then.
        if (req->xfer.id != 0) tcpx_transfer_release(req->xfer);
        delete req;
        return NIXL_SUCCESS;
    });
}

Status Engine::getNotifs(NotifList &notif_list) {
    return guarded("getNotifs", [&] {
        drainNotifications();
        bool none = false;
        {
            std::lock_guard<std::mutex> lock(notifMu_);
            none = notifs_.empty();
            for (auto &n : notifs_) notif_list.push_back(std::move(n));
            notifs_.clear();
        }
        // Applications wait for a notification by polling this in a tight loop (NIXL's
        // check_remote_xfer_done): as in checkXfer, let tcpx's threads have the core.
        if (none) std::this_thread::yield();
        return NIXL_SUCCESS;
    });
}

Status Engine::genNotif(const std::string &remote_agent, const std::string &msg) const {
    return guarded("genNotif", [&] {
        if (msg.size() + wire::notifOverhead(localAgent) > TCPX_NOTIFICATION_MAX_BYTES) {
            logError("notification of " + std::to_string(msg.size()) + " bytes exceeds the limit");
            return NIXL_ERR_INVALID_PARAM;
        }
        const std::string payload = wire::encodeNotif(wire::NotifKind::User, localAgent, msg);
        tcpx_status st = TCPX_OK;
        for (int attempt = 0; attempt < 2; attempt++) {
            tcpx_connection conn{0};
            Status ns = connection(remote_agent, conn);
            if (ns != NIXL_SUCCESS) return ns;
            st = tcpx_connection_notify(conn, reinterpret_cast<const uint8_t *>(payload.data()),
                                        payload.size());
            logDebug("agent '" + localAgent + "' notified agent '" + remote_agent + "' (" +
                     std::to_string(msg.size()) + " bytes): " + statusName(st));
            if (!connectionGone(st)) break;
            forget(remote_agent, conn);
        }
        if (st != TCPX_OK) {
            logError(failure("notification to agent '" + remote_agent + "'", st));
            return toNixl(st);
        }
        return NIXL_SUCCESS;
    });
}

}  // namespace tcpx_nixl
