//! Property tests of the descriptor-list codec (`tcpx_proto::uccl::descs`), which decodes
//! bytes a peer sent: any bytes decode to a list or an error, never a panic; encoding then
//! decoding gives the list back; damage is refused; a registration's keys round-trip and only
//! name ranges inside it.

use proptest::prelude::*;
use tcpx_proto::checksum;
use tcpx_proto::onesided::Descriptor;
use tcpx_proto::uccl::descs::{decode, encode, Desc, RemoteKey, KEY_WORDS};

fn desc() -> impl Strategy<Value = Desc> {
    (
        any::<u64>(),
        any::<u64>(),
        proptest::collection::vec(any::<u32>(), 0..12),
        proptest::collection::vec(any::<u32>(), 0..12),
        proptest::collection::vec(any::<u8>(), 0..80),
    )
        .prop_map(|(addr, size, lkeys, rkeys, ipc_info)| Desc {
            addr,
            size,
            lkeys,
            rkeys,
            ipc_info,
        })
}

/// A valid runtime descriptor, built through its own decoder (its constructor is private
/// to the runtime): version 1, host (1) or CUDA (2) memory.
fn descriptor() -> impl Strategy<Value = Descriptor> {
    (any::<u64>(), 1u64..(1 << 40), 1u8..=2, any::<u64>()).prop_map(|(id, len, kind, key)| {
        let mut b = [0u8; Descriptor::BYTES];
        b[0] = Descriptor::VERSION;
        b[1..9].copy_from_slice(&id.to_le_bytes());
        b[9..17].copy_from_slice(&len.to_le_bytes());
        b[17] = kind;
        b[18..26].copy_from_slice(&key.to_le_bytes());
        Descriptor::from_bytes(&b).expect("a well-formed descriptor")
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn any_bytes_decode_or_fail_without_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn bytes_with_a_valid_header_and_checksum_never_panic(
        count in any::<u32>(),
        body in proptest::collection::vec(any::<u8>(), 0..400),
    ) {
        // Past the magic and the checksum: the decoder must still check every count.
        let mut bytes = b"TXDL\x01\x00\x00\x00".to_vec();
        bytes.extend_from_slice(&count.to_le_bytes());
        bytes.extend_from_slice(&body);
        let hash = checksum::fnv1a(&bytes);
        bytes.extend_from_slice(&hash.to_le_bytes());
        let _ = decode(&bytes);
    }

    #[test]
    fn decode_of_encode_is_identity(list in proptest::collection::vec(desc(), 0..8)) {
        let bytes = encode(&list).unwrap();
        prop_assert_eq!(decode(&bytes).unwrap(), list);
    }

    #[test]
    fn damage_is_refused(
        list in proptest::collection::vec(desc(), 1..4),
        at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
        cut in any::<prop::sample::Index>(),
    ) {
        let bytes = encode(&list).unwrap();
        let mut bad = bytes.clone();
        let i = at.index(bad.len());
        bad[i] ^= flip;
        prop_assert!(decode(&bad).is_err(), "a flipped byte at {} was accepted", i);
        let n = cut.index(bytes.len());
        if n > 0 {
            prop_assert!(decode(&bytes[..n]).is_err(), "a list cut to {} bytes was accepted", n);
        }
        let mut longer = bytes.clone();
        longer.push(0);
        prop_assert!(decode(&longer).is_err());
    }

    #[test]
    fn keys_round_trip_and_lkeys_hide_the_access_key(d in descriptor(), base in any::<u64>()) {
        let key = RemoteKey { descriptor: d, base };
        let rkeys = key.rkeys();
        prop_assert_eq!(rkeys.len(), KEY_WORDS);
        prop_assert_eq!(RemoteKey::from_rkeys(&rkeys).unwrap(), key);
        let lkeys = key.lkeys();
        prop_assert_eq!(lkeys.len(), KEY_WORDS);
        // lkeys name the registration but cannot be used as rkeys to reach it.
        let as_rkeys = RemoteKey::from_rkeys(&lkeys).unwrap();
        prop_assert_eq!(as_rkeys.descriptor.region_id(), d.region_id());
        prop_assert_eq!(as_rkeys.descriptor.key(), 0);
    }

    #[test]
    fn any_words_give_keys_or_an_error(words in proptest::collection::vec(any::<u32>(), 0..12)) {
        let _ = RemoteKey::from_rkeys(&words);
    }

    #[test]
    fn ranges_stay_inside_the_registration(
        d in descriptor(),
        base in any::<u64>(),
        addr in any::<u64>(),
        size in any::<u64>(),
    ) {
        let key = RemoteKey { descriptor: d, base };
        match key.range(addr, size) {
            Ok(r) => {
                prop_assert_eq!(base.checked_add(r.offset), Some(addr));
                prop_assert!(r.offset + r.len <= d.len());
                prop_assert_eq!(r.len, size);
            }
            Err(_) => prop_assert!(
                addr < base || (addr - base).checked_add(size).is_none_or(|e| e > d.len())
            ),
        }
    }
}

#[test]
fn empty_input_is_an_empty_list_and_an_empty_list_round_trips() {
    assert_eq!(decode(&[]).unwrap(), Vec::new());
    let bytes = encode(&[]).unwrap();
    assert_eq!(bytes.len(), 12 + 8);
    assert_eq!(decode(&bytes).unwrap(), Vec::new());
}

#[test]
fn errors_say_what_is_wrong() {
    let one = Desc {
        addr: 0x1000,
        size: 64,
        lkeys: vec![1; 9],
        rkeys: vec![2; 9],
        ipc_info: Vec::new(),
    };
    let bytes = encode(&[one]).unwrap();
    assert!(decode(&bytes[..5]).unwrap_err().0.contains("at least"));
    let mut magic = bytes.clone();
    magic[0] = b'X';
    assert!(decode(&magic).unwrap_err().0.contains("magic"));
    let mut flipped = bytes.clone();
    flipped[20] ^= 1;
    assert!(decode(&flipped).unwrap_err().0.contains("checksum"));
    // A huge count with a matching checksum is refused before anything is allocated.
    let mut huge = b"TXDL\x01\x00\x00\x00\xff\xff\xff\xff".to_vec();
    let hash = checksum::fnv1a(&huge);
    huge.extend_from_slice(&hash.to_le_bytes());
    assert!(decode(&huge).unwrap_err().0.contains("claims"));
    assert!(RemoteKey::from_rkeys(&[0; 8])
        .unwrap_err()
        .0
        .contains("9 words"));
}
