// engine.h: the TCPX backend engine: NIXL's backend interface over the tcpx C API.
//
// One tcpx endpoint per engine (so per NIXL agent), one tcpx connection per remote agent.
// Registered memory becomes a tcpx region with an advertised descriptor; NIXL's transfer
// lists become one-sided tcpx writes / reads (contiguous neighbours merged); notifications
// travel as tcpx notifications that carry the sending agent's name.
//
// Same host: when a peer's connection info carries tcpx same-host info and tcpx says the
// route is CUDA IPC (same kernel boot, same user, GPUs that reach each other), transfers
// whose local and remote lists are both VRAM go through a tcpx local connection (CUDA IPC,
// copy engines, no network); their notifications follow over the network connection once
// the copies completed. Anything else — DRAM, mixed lists, a peer on another host, a local
// connection that cannot be made — takes the network path unchanged.

#ifndef TCPX_NIXL_ENGINE_H
#define TCPX_NIXL_ENGINE_H

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "nixl_backend_abi.h"
#include "tcpx.h"
#include "wire.h"

namespace tcpx_nixl {

using namespace nixl_abi;

/// Name NIXL knows this backend by (`libplugin_TCPX.so`, `backends=["TCPX"]`).
inline constexpr const char *kBackendName = "TCPX";
/// This plugin's version (reported through `get_plugin_version`).
inline constexpr const char *kPluginVersion = "0.1.0";

/// Base of this engine's metadata objects: NIXL hands them back as `BackendMD *`, and the
/// private flag tells a registration (LocalMD) from a loaded peer range (RemoteMD).
struct MD : BackendMD {
    explicit MD(bool is_private) : BackendMD(is_private) {}
    bool isRegistration() const { return isPrivateMD; }
};

/// Memory this engine registered (private metadata, from registerMem).
struct LocalMD final : MD {
    LocalMD() : MD(true) {}
    tcpx_region region{0};
    MemType type = DRAM_SEG;
    uintptr_t base = 0;
    size_t len = 0;
    uint8_t descriptor[TCPX_DESCRIPTOR_BYTES] = {};
    /// VRAM exported for same-host peers (CUDA IPC), when the driver allowed it.
    bool hasIpc = false;
    uint8_t ipcDescriptor[TCPX_IPC_DESCRIPTOR_BYTES] = {};
    /// The CUDA ordinal of VRAM (NIXL's devId); -1 for DRAM.
    int gpu = -1;
    int refs = 1;
};

/// A peer's (or, for local transfers, this agent's own) advertised range (from loadRemoteMD /
/// loadLocalMD); released by unloadMD.
struct RemoteMD final : MD {
    RemoteMD() : MD(false) {}
    std::string agent;
    MemType type = DRAM_SEG;
    uintptr_t base = 0;
    size_t len = 0;
    uint8_t descriptor[TCPX_DESCRIPTOR_BYTES] = {};
    bool hasIpc = false;
    uint8_t ipcDescriptor[TCPX_IPC_DESCRIPTOR_BYTES] = {};
};

/// One prepared transfer: the merged tcpx lists, reusable across postXfer calls.
struct Request final : BackendReqH {
    XferOp op = NIXL_WRITE;
    std::string agent;
    std::vector<tcpx_segment> local;
    std::vector<tcpx_remote_segment> remote;
    /// The same transfer as (local, remote) pairs for CUDA IPC; empty when it cannot take
    /// that route (not VRAM on both sides, a remote range without an IPC descriptor, lists
    /// that do not pair up).
    std::vector<tcpx_ipc_segment> ipc;
    tcpx_connection conn{0};
    tcpx_transfer xfer{0};
    /// Submitted through CUDA IPC (its notification, if any, is sent after completion).
    bool viaIpc = false;
    /// A READ's notification, sent once the read completed (a WRITE's travels with the data).
    std::string pendingNotif;
    bool notifPending = false;
    bool failed = false;
};

/// The TCPX backend engine. Every override catches everything and returns a NIXL status.
class Engine final : public BackendEngine {
public:
    explicit Engine(const BackendInitParams *init);
    ~Engine() override;

    bool supportsRemote() const override { return true; }
    bool supportsLocal() const override { return true; }
    bool supportsNotif() const override { return true; }
    MemList getSupportedMems() const override { return {DRAM_SEG, VRAM_SEG}; }

    Status registerMem(const BlobDesc &mem, const MemType &type, BackendMD *&out) override;
    Status deregisterMem(BackendMD *meta) override;
    Status connect(const std::string &remote_agent) override;
    Status disconnect(const std::string &remote_agent) override;
    Status unloadMD(BackendMD *input) override;

    Status prepXfer(const XferOp &op, const MetaDescList &local, const MetaDescList &remote,
                    const std::string &remote_agent, BackendReqH *&handle,
                    const BackendOptionalArgs *opt_args) const override;
    Status postXfer(const XferOp &op, const MetaDescList &local, const MetaDescList &remote,
                    const std::string &remote_agent, BackendReqH *&handle,
                    const BackendOptionalArgs *opt_args) const override;
    Status checkXfer(BackendReqH *handle) const override;
    Status releaseReqH(BackendReqH *handle) const override;

    Status getPublicData(const BackendMD *meta, std::string &str) const override;
    Status getConnInfo(std::string &str) const override;
    Status loadRemoteConnInfo(const std::string &remote_agent,
                              const std::string &remote_conn_info) override;
    Status loadRemoteMD(const BlobDesc &input, const MemType &type,
                        const std::string &remote_agent, BackendMD *&output) override;
    Status loadLocalMD(BackendMD *input, BackendMD *&output) override;

    Status getNotifs(NotifList &notif_list) override;
    Status genNotif(const std::string &remote_agent, const std::string &msg) const override;

    /// The backend parameters this engine reads (names, with what each means as the value).
    static Params options();

private:
    /// Everything known about one remote agent.
    struct Peer {
        std::vector<uint8_t> metadata;  // from its connection info; empty until loaded
        tcpx_connection conn{0};        // the connection this side sends on
        std::string endpoint;           // control address of the endpoint `conn` reaches
        /// Kept served until disconnect (failed ones are pruned): the duplicate of a
        /// simultaneous dial, or the connection of an instance the name moved away from.
        std::vector<tcpx_connection> others;
        std::vector<uint8_t> localInfo;  // its same-host info; empty when it sent none
        bool ipcRoute = false;           // tcpx said CUDA IPC reaches it
        tcpx_local_connection local{0};  // the same-host connection, dialed at first use
    };
    /// What an accepted connection's Hello said: the dialing agent and its endpoint.
    struct Hello {
        std::string agent;
        std::string endpoint;  // its control address; empty from plugins that did not say
    };

    void init(const BackendInitParams *init);
    void acceptLoop();
    /// Accepts same-host connections (CUDA IPC) and keeps them until the engine goes: a
    /// peer's IPC operations are served by the connection it dialed.
    void acceptLocalLoop();
    /// The same-host connection to `agent`, dialing it when there is none; false (and the
    /// agent's IPC route off from then on) when it cannot be made.
    bool localConnection(const std::string &agent, tcpx_local_connection &out) const;
    /// Pays ahead, on the same-host connection to `agent` (dialed if need be), what its
    /// first CUDA IPC transfer naming `ipcDescriptor` would: confirmation, mapping, copy
    /// streams and list kernel, for the GPU of every VRAM region registered here. Failures
    /// only cost that saving: logged (the transfer path reports them).
    void prepareIpc(const std::string &agent, const uint8_t *ipcDescriptor) const;
    /// Drops `conn` as the same-host connection to `agent` (it failed on submit).
    void forgetLocal(const std::string &agent, tcpx_local_connection conn) const;
    /// Takes every delivered tcpx notification: hellos bind accepted connections, the rest
    /// queue for getNotifs. Caller holds no lock.
    void drainNotifications() const;
    /// The loop of drainNotifications; caller holds notifMu_ (and not mu_).
    void drainLocked() const;
    /// Binds an accepted connection to its agent once both its accept and its hello were seen.
    /// Caller holds mu_.
    void tryBindLocked(const std::string &addr) const;
    /// The connection to send to `agent` on, dialing it when there is none (or it failed).
    Status connection(const std::string &agent, tcpx_connection &out) const;
    /// Drops `conn` as the connection to `agent` (it failed on submit: the peer closed it), so
    /// that the next `connection` dials afresh.
    void forget(const std::string &agent, tcpx_connection conn) const;
    /// The lock that keeps two threads from dialing `agent` at once (dials to other agents
    /// go on meanwhile).
    std::shared_ptr<std::mutex> dialLock(const std::string &agent) const;
    /// Registers every region this engine holds on `conn`'s one-sided comms, so that the
    /// first transfers on it do not pay for that. Failures only cost that saving: logged.
    void warmUp(tcpx_connection conn, const std::vector<tcpx_region> &regions) const;
    /// Warms up the connections bound since the last call (caller holds no lock).
    void flushWarm() const;
    /// Destroys failed connections nobody sends on any more, and with `current` also the
    /// failed ones agents' sends would go to (they then dial afresh). Caller holds no lock.
    void pruneFailed(bool current) const;
    /// registerMem's part under regMu_: the (reference-counted) registration; `created` is
    /// the new tcpx region, or stays null when the range was registered already.
    Status registerLocked(const BlobDesc &mem, const MemType &type, BackendMD *&out,
                          tcpx_region &created);
    Status startTransfer(Request &req, const BackendOptionalArgs *opt_args) const;
    /// Submits `req` through CUDA IPC; NIXL_ERR_NOT_SUPPORTED when no local connection can
    /// be had (the caller takes the network path then).
    Status startIpc(Request &req, bool notify, const std::string &payload) const;
    /// Fills `req.ipc` when the transfer can take the CUDA IPC route (see Request::ipc).
    void buildIpc(const MetaDescList &local, const MetaDescList &remote, Request &req) const;
    Status buildRequest(const XferOp &op, const MetaDescList &local, const MetaDescList &remote,
                        const std::string &agent, Request &req) const;

    tcpx_endpoint ep_{0};
    uint32_t timeoutMs_ = 30000;
    std::vector<uint8_t> metadata_;
    std::vector<uint8_t> localInfo_;
    std::string connInfo_;
    std::string controlAddr_;  // this endpoint's control address, sent in hellos

    mutable std::mutex mu_;  // peers_, accepted_, helloFrom_, dialLocks_, toWarm_
    mutable std::map<std::string, Peer> peers_;
    mutable std::map<std::string, tcpx_connection> accepted_;  // by peer address, not yet named
    mutable std::map<std::string, Hello> helloFrom_;           // by peer address
    mutable std::map<std::string, std::shared_ptr<std::mutex>> dialLocks_;  // by agent
    mutable std::vector<tcpx_connection> toWarm_;  // bound, not warmed up yet

    mutable std::mutex regMu_;  // regs_
    std::map<std::pair<uintptr_t, size_t>, LocalMD *> regs_;  // (address, length) -> refcounted

    mutable std::mutex notifMu_;  // notifBuf_, notifs_
    mutable std::vector<uint8_t> notifBuf_;
    mutable NotifList notifs_;

    /// Serializes same-host dials (localConnection), so one agent is dialed once; taken
    /// before mu_, never while holding it.
    mutable std::mutex dialMu_;
    mutable std::mutex localMu_;  // acceptedLocal_
    std::vector<tcpx_local_connection> acceptedLocal_;

    std::atomic<bool> stop_{false};
    std::thread acceptor_;
    std::thread localAcceptor_;
};

/// NIXL status for a tcpx status.
Status toNixl(tcpx_status s);

/// Logs a line to stderr (NIXL's own logger is not reachable from a plugin without linking
/// libnixl): errors always, the rest when TCPX_NIXL_LOG=info|debug.
void logError(const std::string &what);
void logInfo(const std::string &what);
void logDebug(const std::string &what);

}  // namespace tcpx_nixl

#endif  // TCPX_NIXL_ENGINE_H
