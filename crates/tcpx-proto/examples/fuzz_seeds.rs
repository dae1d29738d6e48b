//! Writes the fuzzers' seed corpus (`crates/tcpx-proto/fuzz/corpus/<target>/`): one valid
//! encoding of every message and format, so the fuzzer starts from the shapes peers really
//! send. `cargo run -p tcpx-proto --example fuzz_seeds -- crates/tcpx-proto/fuzz/corpus`;
//! the files are checked in (`cargo xtask fuzz` runs each target on them).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

use tcpx_proto::control::codec::MessageType;
use tcpx_proto::control::message::{EndpointInfo, ErrorCode, Message, Secret};
use tcpx_proto::control::rma::{ReadRequest, Refusal, RefusalReason, RemoteEntry, WriteRequest};
use tcpx_proto::eager::{header_len, write_header, EagerEntry};
use tcpx_proto::metadata::EndpointMetadata;
use tcpx_proto::onesided::Descriptor;
use tcpx_proto::uccl::advert::Advert;
use tcpx_proto::uccl::descs::{encode, Desc, RemoteKey};
use tcpx_proto::uccl::metadata::uccl_metadata;
use tcpx_proto::MemoryKind;

fn info() -> EndpointInfo {
    EndpointInfo {
        ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
        gpu_pci: Some("0000:8a:00.0".into()),
        channels: 8,
        plugin_name: "GPUDirectTCPX_v7".into(),
        abi_version: 7,
        chunk_bytes: 512 << 10,
        gpu_index: Some(3),
        spread: 8,
        eager_bytes: 64 << 10,
        spread_two_sided: true,
    }
}

fn messages() -> Vec<Message> {
    let entries = vec![
        RemoteEntry {
            region_id: 1,
            key: 0xfeed,
            offset: 0,
            len: 4096,
        },
        RemoteEntry {
            region_id: 2,
            key: 0xbeef,
            offset: 8192,
            len: 16384,
        },
    ];
    vec![
        Message::hello_presenting(info(), Some(Secret::from_bytes([5; 16]))),
        Message::hello(info()),
        Message::ConnectHandles {
            handles: vec![[7u8; 128]; 2],
        },
        Message::Ready,
        Message::Close {
            reason: "done".into(),
        },
        Message::Error {
            code: ErrorCode(2),
            message: "plugin failed".into(),
        },
        Message::Segments {
            transfer_id: 9,
            lens: vec![4096, 65536, 1 << 20],
        },
        Message::WriteRequest(WriteRequest {
            op_id: 11,
            entries: entries.clone(),
            local_lens: vec![4096, 16384],
            notification: Some(b"layer 3 done".to_vec()),
            packed: true,
            spread: false,
            inline: None,
        }),
        Message::WriteRequest(WriteRequest {
            op_id: 13,
            entries: entries.clone(),
            local_lens: vec![64],
            notification: None,
            packed: false,
            spread: false,
            inline: Some(vec![0x5a; 64]),
        }),
        Message::ReadRequest(ReadRequest {
            op_id: 12,
            entries,
            local_lens: vec![20480],
            pack: false,
            spread: true,
            inline: false,
        }),
        Message::Notify {
            bytes: b"hello".to_vec(),
        },
        Message::WriteAck {
            op_id: 11,
            refusal: None,
        },
        Message::WriteAck {
            op_id: 13,
            refusal: Some(Refusal {
                index: 1,
                reason: RefusalReason::WrongKey,
            }),
        },
        Message::ReadData {
            op_id: 12,
            packed: true,
        },
        Message::ReadRefused {
            op_id: 14,
            refusal: Refusal {
                index: 0,
                reason: RefusalReason::OutOfBounds,
            },
        },
        Message::ReadInline {
            op_id: 15,
            data: vec![0xa5; 96],
        },
    ]
}

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) {
    let d = dir.join(target);
    std::fs::create_dir_all(&d).expect("corpus dir");
    std::fs::write(d.join(name), bytes).expect("seed file");
}

fn main() {
    let dir = std::env::args().nth(1).unwrap_or_else(|| "corpus".into());
    let dir = Path::new(&dir);
    let mut stream = vec![64u8]; // control_frames: first byte = piece size
    for (i, m) in messages().iter().enumerate() {
        let mut wire = Vec::new();
        m.encode(&mut wire).expect("seed message encodes");
        stream.extend_from_slice(&wire);
        // messages: u16 type, then the payload (past the 12-byte frame header).
        let mut typed = MessageType::code(m.kind()).to_le_bytes().to_vec();
        typed.extend_from_slice(&wire[12..]);
        write(dir, "messages", &format!("{i:02}-{:?}", m.kind()), &typed);
        let mut one = vec![7u8];
        one.extend_from_slice(&wire);
        write(
            dir,
            "control_frames",
            &format!("{i:02}-{:?}", m.kind()),
            &one,
        );
    }
    write(dir, "control_frames", "all", &stream);
    for (name, ip) in [
        ("v4", IpAddr::V4(Ipv4Addr::LOCALHOST)),
        ("v6", IpAddr::V6(Ipv6Addr::LOCALHOST)),
    ] {
        let m = EndpointMetadata {
            info: EndpointInfo { ip, ..info() },
            control_addr: SocketAddr::new(ip, 7400),
            secret: Secret::from_bytes([1; 16]),
        };
        write(
            dir,
            "metadata",
            name,
            &m.to_bytes().expect("metadata encodes"),
        );
        write(
            dir,
            "uccl_metadata",
            name,
            &uccl_metadata(SocketAddr::new(ip, 7400), "0000:8a:00.0"),
        );
    }
    // eager_frame: the agreed eager size (4 bytes), then a frame of two inline messages and a
    // detached one (its bytes are not in the frame).
    let entries = [
        EagerEntry {
            seq: 64,
            len: 4096,
            detached: false,
        },
        EagerEntry {
            seq: 65,
            len: 1,
            detached: false,
        },
        EagerEntry {
            seq: 66,
            len: 100,
            detached: true,
        },
    ];
    let mut frame = vec![0u8; header_len(entries.len())];
    write_header(&entries, &mut frame);
    frame.extend(std::iter::repeat_n(7u8, 4096 + 1));
    let mut seed = (64u32 << 10).to_le_bytes().to_vec();
    seed.extend_from_slice(&frame);
    write(dir, "eager_frame", "three", &seed);
    let mut old = vec![127, 0, 0, 1, 0x1c, 0xe8];
    old.extend_from_slice(&3i32.to_ne_bytes());
    write(dir, "uccl_metadata", "older-index", &old);
    let d = Descriptor::new(42, 1 << 20, MemoryKind::Cuda, 0x0123_4567_89ab_cdef);
    write(dir, "onesided_descriptor", "cuda", &d.to_bytes());
    write(
        dir,
        "onesided_descriptor",
        "host",
        &Descriptor::new(1, 4096, MemoryKind::Host, 7).to_bytes(),
    );
    let a = Advert {
        addr: 0x7f00_0000_1000,
        len: 4096,
        offset: 4096,
        descriptor: d,
    };
    write(dir, "uccl_advert", "one", &a.encode());
    let key = RemoteKey {
        descriptor: d,
        base: 0x7f00_0000_0000,
    };
    let descs = vec![
        Desc {
            addr: 0x7f00_0000_0000,
            size: 4096,
            lkeys: key.lkeys(),
            rkeys: key.rkeys(),
            ipc_info: vec![],
        },
        Desc {
            addr: 0x7f00_0000_4000,
            size: 16384,
            lkeys: key.lkeys(),
            rkeys: key.rkeys(),
            ipc_info: vec![9; 128],
        },
    ];
    write(
        dir,
        "uccl_descs",
        "two",
        &encode(&descs).expect("descs encode"),
    );
    write(
        dir,
        "uccl_descs",
        "empty",
        &encode(&[]).expect("empty list encodes"),
    );
    let handle = tcpx_proto::ipc::IpcMemHandle::from_bytes([0x5a; 64]);
    let ipc = tcpx_proto::ipc::IpcDescriptor {
        handle,
        owner: 77,
        owner_pid: 4242,
        base: 0x7f00_0000_0000,
        alloc_len: 2 << 20,
        offset: 4096,
        len: 1 << 20,
        key: 0xabcdef,
    };
    write(dir, "ipc_descriptor", "one", &ipc.to_bytes());
    let info_local = tcpx_proto::ipc::identity::LocalInfo {
        boot_id: [3; 16],
        uid: 1000,
        pid: 4242,
        instance: 77,
        name: "tcpx-ipc/1000/ep/127.0.0.1:5000".into(),
        gpu: Some("0000:8a:00.0".into()),
        hostname: "a3-1".into(),
    };
    write(
        dir,
        "local_info",
        "one",
        &info_local.to_bytes().expect("local info encodes"),
    );
    use tcpx_proto::ipc::wire::{Hello, Msg};
    let msgs = [
        Msg::Hello(Hello {
            version: 1,
            pid: 4242,
            instance: 77,
            boot_id: [3; 16],
            gpu_ordinal: Some(0),
            gpu_bus: Some("0000:8a:00.0".into()),
            hostname: "a3-1".into(),
        }),
        Msg::Validate {
            req: 1,
            key: 0xabcdef,
            handle,
            offset: 4096,
            len: 1 << 20,
        },
        Msg::Granted { req: 1 },
        Msg::Refused {
            req: 2,
            reason: "unknown key".into(),
        },
        Msg::Revoke {
            req: 3,
            key: 0xabcdef,
        },
        Msg::RevokeAck { req: 3 },
        Msg::Goodbye {
            req: 4,
            reason: "closing".into(),
        },
        Msg::GoodbyeAck { req: 4 },
    ];
    for (i, m) in msgs.iter().enumerate() {
        write(dir, "ipc_local_msg", &format!("{i:02}"), &m.encode()[4..]);
    }
    use tcpx_proto::nixl;
    let meta = EndpointMetadata {
        info: info(),
        control_addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 7400),
        secret: Secret::from_bytes([1; 16]),
    }
    .to_bytes()
    .expect("metadata encodes");
    let local = info_local.to_bytes().expect("local info encodes");
    for (name, l) in [("conn", &[][..]), ("conn-local", &local[..])] {
        let mut b = vec![0u8];
        b.extend(nixl::encode_conn_info(&meta, l).expect("conn info encodes"));
        write(dir, "nixl_formats", name, &b);
    }
    for (name, ipc) in [("mem", None), ("mem-ipc", Some(ipc.to_bytes()))] {
        let mut b = vec![1u8];
        b.extend(
            nixl::PublicMem {
                mem_type: 1,
                base: 0x7f00_0000_0000,
                len: 1 << 20,
                descriptor: d.to_bytes(),
                ipc,
            }
            .encode(),
        );
        write(dir, "nixl_formats", name, &b);
    }
    let mut b = vec![2u8];
    b.extend(
        nixl::encode_notif(nixl::NotifKind::User, b"agent-a", b"layer 3 done")
            .expect("notif encodes"),
    );
    write(dir, "nixl_formats", "notif", &b);
    println!("seeds written under {}", dir.display());
}
