//! Properties of the control codec, the messages and the metadata blob: arbitrary values
//! round-trip, and arbitrary or damaged input is refused without panicking or over-allocating.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use proptest::prelude::*;
use tcpx_runtime::control::codec::{HEADER_LEN, MAGIC};
use tcpx_runtime::control::rma::MAX_INLINE;
use tcpx_runtime::control::{
    CodecError, Decoder, EndpointInfo, EndpointMetadata, ErrorCode, Frame, Message, MessageType,
    Secret, PROTOCOL_VERSION, SECRET_BYTES,
};
use tcpx_runtime::onesided::{
    Descriptor, ReadRequest, Refusal, RefusalReason, RemoteEntry, WriteRequest,
};

fn ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(|o| IpAddr::V4(Ipv4Addr::from(o))),
        any::<[u8; 16]>().prop_map(|o| IpAddr::V6(Ipv6Addr::from(o))),
    ]
}

fn endpoint_info() -> impl Strategy<Value = EndpointInfo> {
    (
        ip(),
        proptest::option::of(".{0,20}"),
        any::<u16>(),
        ".{0,30}",
        any::<u8>(),
        any::<u32>(),
        proptest::option::of(any::<u32>()),
        any::<u16>(),
        0u32..=tcpx_proto::eager::EAGER_MAX_MESSAGE,
        any::<bool>(),
    )
        .prop_map(
            |(
                ip,
                gpu_pci,
                channels,
                plugin_name,
                abi_version,
                chunk_bytes,
                gpu_index,
                spread,
                eager_bytes,
                spread_two_sided,
            )| {
                EndpointInfo {
                    ip,
                    gpu_pci,
                    channels,
                    plugin_name,
                    abi_version,
                    chunk_bytes,
                    gpu_index,
                    spread,
                    eager_bytes,
                    spread_two_sided,
                }
            },
        )
}

fn secret() -> impl Strategy<Value = Secret> {
    any::<[u8; SECRET_BYTES]>().prop_map(Secret::from_bytes)
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (
            any::<u16>(),
            endpoint_info(),
            proptest::option::of(secret())
        )
            .prop_map(|(protocol_version, endpoint, secret)| Message::Hello {
                protocol_version,
                endpoint,
                secret
            }),
        proptest::collection::vec(any::<[u8; 128]>(), 0..10)
            .prop_map(|handles| Message::ConnectHandles { handles }),
        Just(Message::Ready),
        ".{0,50}".prop_map(|reason| Message::Close { reason }),
        (any::<u32>(), ".{0,50}").prop_map(|(code, message)| Message::Error {
            code: ErrorCode(code),
            message
        }),
        (any::<u64>(), proptest::collection::vec(any::<u64>(), 0..50))
            .prop_map(|(transfer_id, lens)| Message::Segments { transfer_id, lens }),
        onesided_message(),
    ]
}

fn entries() -> impl Strategy<Value = Vec<RemoteEntry>> {
    proptest::collection::vec(
        any::<(u64, u64, u64, u64)>().prop_map(|(region_id, key, offset, len)| RemoteEntry {
            region_id,
            key,
            offset,
            len,
        }),
        0..40,
    )
}

fn refusal() -> impl Strategy<Value = Refusal> {
    (
        any::<u32>(),
        prop_oneof![
            Just(RefusalReason::UnknownRegion),
            Just(RefusalReason::WrongKey),
            Just(RefusalReason::Revoked),
            Just(RefusalReason::OutOfBounds),
            Just(RefusalReason::UnsupportedMemory),
        ],
    )
        .prop_map(|(index, reason)| Refusal { index, reason })
}

fn onesided_message() -> impl Strategy<Value = Message> {
    let lens = || proptest::collection::vec(any::<u64>(), 0..40);
    let blob = || proptest::collection::vec(any::<u8>(), 0..300);
    prop_oneof![
        (
            any::<u64>(),
            entries(),
            lens(),
            proptest::option::of(blob()),
            any::<bool>(),
            any::<bool>(),
            proptest::option::of(blob()),
        )
            .prop_map(
                |(op_id, entries, local_lens, notification, packed, spread, inline)| {
                    Message::WriteRequest(WriteRequest {
                        op_id,
                        entries,
                        local_lens,
                        notification,
                        // Inline data is never packed (the decoder refuses both).
                        packed: packed && inline.is_none(),
                        spread,
                        inline,
                    })
                }
            ),
        (
            any::<u64>(),
            entries(),
            lens(),
            any::<bool>(),
            any::<bool>(),
            any::<bool>()
        )
            .prop_map(|(op_id, entries, local_lens, pack, spread, inline)| {
                Message::ReadRequest(ReadRequest {
                    op_id,
                    entries,
                    local_lens,
                    // An inline answer is never packed (the decoder refuses both).
                    pack: pack && !inline,
                    spread,
                    inline,
                })
            }),
        (any::<u64>(), blob()).prop_map(|(op_id, data)| Message::ReadInline { op_id, data }),
        blob().prop_map(|bytes| Message::Notify { bytes }),
        (any::<u64>(), proptest::option::of(refusal()))
            .prop_map(|(op_id, refusal)| Message::WriteAck { op_id, refusal }),
        (any::<u64>(), any::<bool>())
            .prop_map(|(op_id, packed)| Message::ReadData { op_id, packed }),
        (any::<u64>(), refusal())
            .prop_map(|(op_id, refusal)| Message::ReadRefused { op_id, refusal }),
    ]
}

fn descriptor() -> impl Strategy<Value = Descriptor> {
    (any::<u64>(), any::<u64>(), any::<bool>(), any::<u64>()).prop_map(|(id, len, cuda, key)| {
        let mut bytes = [0u8; Descriptor::BYTES];
        bytes[0] = Descriptor::VERSION;
        bytes[1..9].copy_from_slice(&id.to_le_bytes());
        bytes[9..17].copy_from_slice(&len.to_le_bytes());
        bytes[17] = if cuda { 2 } else { 1 };
        bytes[18..26].copy_from_slice(&key.to_le_bytes());
        Descriptor::from_bytes(&bytes).unwrap()
    })
}

const ONESIDED_TYPES: [MessageType; 7] = [
    MessageType::WriteRequest,
    MessageType::ReadRequest,
    MessageType::Notify,
    MessageType::WriteAck,
    MessageType::ReadData,
    MessageType::ReadRefused,
    MessageType::ReadInline,
];

/// Feeds `bytes` to `decoder` in pieces cut at `cuts`, collecting frames until an error.
fn feed_in_pieces(
    decoder: &mut Decoder,
    bytes: &[u8],
    cuts: &[usize],
) -> (Vec<Frame>, Option<CodecError>) {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    points.push(bytes.len());
    points.sort_unstable();
    let mut frames = Vec::new();
    let mut start = 0;
    for end in points {
        let mut input = &bytes[start..end];
        start = end;
        loop {
            match decoder.decode(&mut input) {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => break,
                Err(e) => return (frames, Some(e)),
            }
            assert!(decoder.reserved_bytes() <= decoder.max_payload() as usize);
        }
        assert!(decoder.reserved_bytes() <= decoder.max_payload() as usize);
    }
    (frames, None)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn messages_round_trip_through_any_split(
        msgs in proptest::collection::vec(message(), 1..5),
        cuts in proptest::collection::vec(any::<usize>(), 0..8),
    ) {
        let mut wire = Vec::new();
        for m in &msgs {
            m.encode(&mut wire).unwrap();
        }
        let mut decoder = Decoder::new();
        let (frames, err) = feed_in_pieces(&mut decoder, &wire, &cuts);
        prop_assert_eq!(err, None);
        let decoded: Vec<Message> = frames.iter().map(|f| Message::decode(f).unwrap()).collect();
        prop_assert_eq!(decoded, msgs);
        prop_assert!(decoder.finish().is_ok());
    }

    #[test]
    fn truncated_frames_are_reported_at_end_of_stream(
        msg in message(),
        cut in any::<usize>(),
    ) {
        let mut wire = Vec::new();
        msg.encode(&mut wire).unwrap();
        let cut = cut % wire.len(); // strictly shorter than the frame
        let mut decoder = Decoder::new();
        let mut input = &wire[..cut];
        prop_assert_eq!(decoder.decode(&mut input), Ok(None));
        prop_assert_eq!(decoder.is_mid_frame(), cut > 0);
        if cut > 0 {
            let is_truncated = matches!(decoder.finish(), Err(CodecError::Truncated { .. }));
            prop_assert!(is_truncated);
        }
    }

    #[test]
    fn random_bytes_never_panic_or_overallocate(
        cap in 0u32..4096,
        valid_magic in any::<bool>(),
        mut bytes in proptest::collection::vec(any::<u8>(), 0..6000),
        cuts in proptest::collection::vec(any::<usize>(), 0..8),
    ) {
        // Half the cases get a plausible header start so the payload path is exercised too.
        if valid_magic && bytes.len() >= 8 {
            bytes[..4].copy_from_slice(&MAGIC);
            bytes[4..6].copy_from_slice(&1u16.to_le_bytes());
            bytes[6] %= 7;
            bytes[7] = 0;
        }
        let mut decoder = Decoder::with_max_payload(cap);
        let (frames, _err) = feed_in_pieces(&mut decoder, &bytes, &cuts);
        for frame in &frames {
            prop_assert!(frame.payload.len() <= cap as usize);
            // Payload decoding of garbage may fail, but must not panic.
            let _ = Message::decode(frame);
        }
    }

    #[test]
    fn corrupted_frames_never_panic(
        msg in message(),
        flips in proptest::collection::vec((any::<usize>(), 1u8..=255), 1..4),
    ) {
        let mut wire = Vec::new();
        msg.encode(&mut wire).unwrap();
        for (pos, mask) in flips {
            let i = pos % wire.len();
            wire[i] ^= mask;
        }
        let mut decoder = Decoder::new();
        let (frames, err) = feed_in_pieces(&mut decoder, &wire, &[]);
        for frame in &frames {
            let _ = Message::decode(frame);
        }
        // A damaged header must be caught by the decoder or leave a frame incomplete.
        if frames.is_empty() && err.is_none() {
            prop_assert!(decoder.finish().is_err());
        }
    }

    #[test]
    fn descriptors_round_trip_and_damage_never_panics(
        d in descriptor(),
        cut in any::<usize>(),
        flip in (any::<usize>(), 1u8..=255),
        garbage in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let bytes = d.to_bytes();
        prop_assert_eq!(Descriptor::from_bytes(&bytes).unwrap(), d);
        prop_assert!(Descriptor::from_bytes(&bytes[..cut % bytes.len()]).is_err());
        let mut damaged = bytes;
        let i = flip.0 % damaged.len();
        damaged[i] ^= flip.1;
        if let Ok(other) = Descriptor::from_bytes(&damaged) {
            // The version byte never changes undetected; other fields decode to another value.
            prop_assert!(i > 0);
            prop_assert_ne!(other, d);
        }
        let _ = Descriptor::from_bytes(&garbage);
    }

    #[test]
    fn onesided_payloads_survive_random_and_truncated_bytes(
        msg in onesided_message(),
        cut in any::<usize>(),
        kind in 0usize..6,
        garbage in proptest::collection::vec(any::<u8>(), 0..600),
    ) {
        let mut wire = Vec::new();
        msg.encode(&mut wire).unwrap();
        let payload = &wire[HEADER_LEN..];
        // Every strict prefix of a payload is refused (never a panic, never a wrong message).
        if !payload.is_empty() {
            let frame = Frame {
                version: PROTOCOL_VERSION,
                kind: msg.kind(),
                payload: payload[..cut % payload.len()].to_vec(),
            };
            prop_assert!(Message::decode(&frame).is_err());
        }
        // Random payloads under any one-sided type: decoded or refused, never a panic, and
        // whatever decodes re-encodes to the same bytes.
        let frame = Frame { version: PROTOCOL_VERSION, kind: ONESIDED_TYPES[kind], payload: garbage };
        if let Ok(decoded) = Message::decode(&frame) {
            let mut again = Vec::new();
            decoded.encode(&mut again).unwrap();
            prop_assert_eq!(&again[HEADER_LEN..], &frame.payload[..]);
        }
    }

    #[test]
    fn metadata_round_trips(
        info in endpoint_info(),
        addr_ip in ip(),
        port in any::<u16>(),
        secret in secret(),
    ) {
        let meta = EndpointMetadata { info, control_addr: SocketAddr::new(addr_ip, port), secret };
        let bytes = meta.to_bytes().unwrap();
        prop_assert_eq!(EndpointMetadata::from_bytes(&bytes).unwrap(), meta.clone());
        let hex = meta.to_hex().unwrap();
        prop_assert_eq!(hex.parse::<EndpointMetadata>().unwrap(), meta);
    }

    #[test]
    fn damaged_or_random_metadata_is_refused_without_panic(
        info in endpoint_info(),
        cut in any::<usize>(),
        flip in (any::<usize>(), 1u8..=255),
        garbage in proptest::collection::vec(any::<u8>(), 0..300),
        text in ".{0,200}",
    ) {
        let meta = EndpointMetadata {
            info,
            control_addr: SocketAddr::from(([127, 0, 0, 1], 7000)),
            secret: tcpx_runtime::control::random_secret(),
        };
        let bytes = meta.to_bytes().unwrap();
        let cut = cut % bytes.len();
        prop_assert!(EndpointMetadata::from_bytes(&bytes[..cut]).is_err());
        let mut damaged = bytes.clone();
        let i = flip.0 % damaged.len();
        damaged[i] ^= flip.1;
        prop_assert!(EndpointMetadata::from_bytes(&damaged).is_err());
        let _ = EndpointMetadata::from_bytes(&garbage);
        let _ = EndpointMetadata::from_hex(&text);
    }
}

#[test]
fn ready_is_a_bare_twelve_byte_header() {
    let mut wire = Vec::new();
    Message::Ready.encode(&mut wire).unwrap();
    assert_eq!(wire.len(), HEADER_LEN);
    assert_eq!(&wire[..4], b"TXCP");
}

#[test]
fn packing_flags_with_unknown_bits_are_refused() {
    let messages = [
        Message::WriteRequest(WriteRequest {
            op_id: 7,
            entries: Vec::new(),
            local_lens: vec![4096],
            notification: None,
            packed: true,
            spread: false,
            inline: None,
        }),
        Message::ReadRequest(ReadRequest {
            op_id: 7,
            entries: Vec::new(),
            local_lens: vec![4096],
            pack: true,
            spread: false,
            inline: false,
        }),
        Message::ReadData {
            op_id: 7,
            packed: true,
        },
    ];
    for msg in messages {
        let mut wire = Vec::new();
        msg.encode(&mut wire).unwrap();
        let mut payload = wire[HEADER_LEN..].to_vec();
        // The flag byte is the last one of each payload.
        let last = payload.len() - 1;
        assert_eq!(payload[last], 1);
        let frame = |payload: Vec<u8>| Frame {
            version: PROTOCOL_VERSION,
            kind: msg.kind(),
            payload,
        };
        assert_eq!(Message::decode(&frame(payload.clone())).unwrap(), msg);
        // Requests know bit 1 too (spread); `ReadData` knows bit 0 only. Bit 2 (inline) never
        // goes with bit 0, and a write's announces data that is not there.
        let unknown: &[u8] = match msg {
            Message::ReadData { .. } => &[2, 3, 0x80, 0xff],
            Message::ReadRequest(_) => &[5, 8, 0x80, 0xff],
            _ => &[4, 5, 8, 0x80, 0xff],
        };
        for &bad in unknown {
            payload[last] = bad;
            assert!(
                Message::decode(&frame(payload.clone())).is_err(),
                "{bad:#x}"
            );
        }
    }
}

#[test]
fn inline_write_data_follows_the_flags_and_is_checked() {
    let msg = Message::WriteRequest(WriteRequest {
        op_id: 9,
        entries: Vec::new(),
        local_lens: vec![3],
        notification: None,
        packed: false,
        spread: true,
        inline: Some(vec![7, 8, 9]),
    });
    let mut wire = Vec::new();
    msg.encode(&mut wire).unwrap();
    let payload = wire[HEADER_LEN..].to_vec();
    // Flags (spread | inline), then u32 length 3, then the bytes.
    assert_eq!(&payload[payload.len() - 8..], &[6, 3, 0, 0, 0, 7, 8, 9]);
    let frame = |payload: Vec<u8>| Frame {
        version: PROTOCOL_VERSION,
        kind: MessageType::WriteRequest,
        payload,
    };
    assert_eq!(Message::decode(&frame(payload.clone())).unwrap(), msg);
    // Inline and packed together: refused.
    let mut both = payload.clone();
    let flags = both.len() - 8;
    both[flags] |= 1;
    assert!(Message::decode(&frame(both)).is_err());
    // A length past the bytes present, or past the cap: refused before any allocation.
    let mut short = payload.clone();
    short[flags + 1] = 4;
    assert!(Message::decode(&frame(short)).is_err());
    let mut huge = payload[..flags + 1].to_vec();
    huge.extend_from_slice(&(MAX_INLINE as u32 + 1).to_le_bytes());
    huge.extend(std::iter::repeat_n(0u8, MAX_INLINE + 1));
    assert!(Message::decode(&frame(huge)).is_err());
    // Encoding refuses data past the cap as well.
    let too_long = Message::WriteRequest(WriteRequest {
        op_id: 9,
        entries: Vec::new(),
        local_lens: Vec::new(),
        notification: None,
        packed: false,
        spread: false,
        inline: Some(vec![0; MAX_INLINE + 1]),
    });
    assert!(too_long.encode(&mut Vec::new()).is_err());
}

#[test]
fn refusal_reason_codes_are_one_to_five_and_nothing_else() {
    let reasons = [
        RefusalReason::UnknownRegion,
        RefusalReason::WrongKey,
        RefusalReason::Revoked,
        RefusalReason::OutOfBounds,
        RefusalReason::UnsupportedMemory,
    ];
    let msg = |reason| Message::ReadRefused {
        op_id: 9,
        refusal: Refusal { index: 3, reason },
    };
    let frame = |payload: Vec<u8>| Frame {
        version: PROTOCOL_VERSION,
        kind: msg(RefusalReason::UnknownRegion).kind(),
        payload,
    };
    for (code, reason) in (1u8..).zip(reasons) {
        let mut wire = Vec::new();
        msg(reason).encode(&mut wire).unwrap();
        let payload = wire[HEADER_LEN..].to_vec();
        // The reason code is the last byte of a `ReadRefused` payload.
        assert_eq!(payload[payload.len() - 1], code, "{reason:?}");
        assert_eq!(Message::decode(&frame(payload)).unwrap(), msg(reason));
    }
    let mut wire = Vec::new();
    msg(RefusalReason::UnsupportedMemory)
        .encode(&mut wire)
        .unwrap();
    let mut payload = wire[HEADER_LEN..].to_vec();
    let last = payload.len() - 1;
    for bad in [0u8, 6, 7, 0x80, 0xff] {
        payload[last] = bad;
        assert!(Message::decode(&frame(payload.clone())).is_err(), "{bad}");
    }
}
