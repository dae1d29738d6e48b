//! Properties of the control codec, the messages and the metadata blob: arbitrary values
//! round-trip, and arbitrary or damaged input is refused without panicking or over-allocating.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use proptest::prelude::*;
use tcpx_runtime::control::codec::{HEADER_LEN, MAGIC};
use tcpx_runtime::control::{
    CodecError, Decoder, EndpointInfo, EndpointMetadata, ErrorCode, Frame, Message,
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
    )
        .prop_map(
            |(ip, gpu_pci, channels, plugin_name, abi_version, chunk_bytes)| EndpointInfo {
                ip,
                gpu_pci,
                channels,
                plugin_name,
                abi_version,
                chunk_bytes,
            },
        )
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (any::<u16>(), endpoint_info()).prop_map(|(protocol_version, endpoint)| Message::Hello {
            protocol_version,
            endpoint
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
    ]
}

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
    fn metadata_round_trips(info in endpoint_info(), addr_ip in ip(), port in any::<u16>()) {
        let meta = EndpointMetadata { info, control_addr: SocketAddr::new(addr_ip, port) };
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
