//! Caller-owned memory ([`Endpoint::register_ptr`]) and address-only connects
//! ([`Endpoint::connect_addr`]): transfers from and into a `Vec` the test owns, both kinds
//! of connect with the GPU index each side announced, and the same range and access checks
//! as for memory the runtime allocated.

mod common;

use common::*;
use tcpx_runtime::{Descriptor, Endpoint, Error, Region, RemoteSegment, Segment};

const KIB: usize = 1 << 10;

/// Registers `bytes` (owned by the caller, who keeps it alive past every use of the region).
fn register_vec(ep: &Endpoint, bytes: &mut [u8]) -> Region {
    // SAFETY: every test below drops the region, its connections and transfers before the
    // vector, and touches the vector only while no transfer is in flight.
    unsafe { ep.register_ptr(bytes.as_mut_ptr(), bytes.len()) }.expect("register_ptr")
}

#[test]
fn transfers_move_bytes_from_and_into_caller_owned_vectors() {
    loopback();
    let (a, b, ab, ba) = pair(2, 64 * KIB as u32);
    let len = 640 * KIB + 3;
    let mut src = vec![0u8; len + 100];
    fill(&mut src[100..], 41);
    let mut dst = vec![0u8; len + 7];
    {
        let src_region = register_vec(&a, &mut src);
        let dst_region = register_vec(&b, &mut dst);
        assert_eq!(src_region.len(), len + 100);
        assert_eq!(src_region.kind(), tcpx::MemoryKind::Host);
        assert!(!src_region.is_staged());
        let rx = ba.recv(&dst_region, 7, len).unwrap();
        let tx = ab.send(&src_region, 100, len).unwrap();
        assert_eq!(tx.wait(DEADLINE).unwrap(), len as u64);
        assert_eq!(rx.wait(DEADLINE).unwrap(), len as u64);

        // The other way, between runtime-allocated and caller-owned memory.
        let back = source(&b, len, 42);
        let rx = ab.recv(&src_region, 0, len).unwrap();
        let tx = ba.send(&back, 0, len).unwrap();
        assert_eq!(tx.wait(DEADLINE).unwrap(), len as u64);
        assert_eq!(rx.wait(DEADLINE).unwrap(), len as u64);
        drop((ab, ba));
    }
    // The regions and connections are gone; the bytes landed in the vectors themselves.
    check(&dst[7..], 41).unwrap_or_else(|at| panic!("a->b differs at byte {at}"));
    assert!(dst[..7].iter().all(|&x| x == 0), "bytes before the offset");
    check(&src[..len], 42).unwrap_or_else(|at| panic!("b->a differs at byte {at}"));
    assert_eq!(a.live_registrations() + b.live_registrations(), 0);
}

#[test]
fn caller_owned_regions_check_ranges_like_allocated_ones() {
    loopback();
    let (a, b, ab, _ba) = pair(1, 64 * KIB as u32);
    let mut mine = vec![0u8; 8 * KIB];
    let mut theirs = vec![0u8; 8 * KIB];
    let region = register_vec(&a, &mut mine);
    assert_eq!(region.as_ptr(), mine.as_mut_ptr());
    assert_eq!(region.as_ptr(), region.memory().as_ptr());

    // Local ranges outside the memory, or overflowing, are refused before anything moves.
    for (offset, len) in [(8 * KIB, 1), (1, 8 * KIB), (usize::MAX, 2)] {
        assert!(
            matches!(
                ab.send(&region, offset, len),
                Err(Error::InvalidArgument(_))
            ),
            "send {offset}+{len}"
        );
        assert!(
            matches!(
                ab.recv(&region, offset, len),
                Err(Error::InvalidArgument(_))
            ),
            "recv {offset}+{len}"
        );
    }

    // One-sided: a caller-owned region advertised on b. A range beyond it is refused on
    // a's side already; a forged descriptor claiming more than the region holds gets past
    // that and is refused by b, as is the region once revoked; nothing changes there.
    let target = register_vec(&b, &mut theirs);
    let d = b.advertise(&target).unwrap();
    assert!(matches!(
        ab.write(
            &[Segment::new(&region, 0, 4 * KIB)],
            &[RemoteSegment::new(d, 6 << 10, 4 << 10)],
            None,
        ),
        Err(Error::InvalidArgument(ref why)) if why.contains("outside")
    ));
    let mut long = d.to_bytes();
    long[9..17].copy_from_slice(&(64u64 << 10).to_le_bytes());
    let long = Descriptor::from_bytes(&long).unwrap();
    let (index, why) = access_error(
        ab.write(
            &[Segment::new(&region, 0, 4 * KIB)],
            &[RemoteSegment::new(long, 6 << 10, 4 << 10)],
            None,
        )
        .unwrap()
        .wait(DEADLINE),
    );
    assert_eq!(index, 0);
    assert!(why.contains("outside"), "{why}");
    assert!(b.revoke(&d));
    let (_, why) = access_error(
        ab.read(
            &[Segment::new(&region, 0, KIB)],
            &[RemoteSegment::new(d, 0, 1 << 10)],
        )
        .unwrap()
        .wait(DEADLINE),
    );
    assert!(why.contains("revoked"), "{why}");
    assert!(b.access_refusals() >= 2);
    drop((region, target, ab, _ba));
    assert!(mine.iter().all(|&x| x == 0) && theirs.iter().all(|&x| x == 0));
}

#[test]
fn null_and_empty_pointers_are_refused() {
    loopback();
    let ep = Endpoint::new(config(1, 64 * KIB as u32)).unwrap();
    let mut one = [0u8; 1];
    // SAFETY: every call either fails or registers `one`, which outlives the region.
    unsafe {
        assert!(matches!(
            ep.register_ptr(std::ptr::null_mut(), 16),
            Err(Error::InvalidArgument(ref why)) if why.contains("null")
        ));
        assert!(matches!(
            ep.register_ptr(one.as_mut_ptr(), 0),
            Err(Error::InvalidArgument(_))
        ));
        assert!(ep.register_ptr(one.as_mut_ptr(), 1).is_ok());
    }
}

#[test]
fn connect_addr_needs_only_the_address_and_both_sides_see_the_peer_gpu() {
    loopback();
    let cfg = |gpu: Option<u32>| {
        let mut c = config(2, 64 * KIB as u32);
        c.gpu_index = gpu;
        c
    };
    let a = Endpoint::new(cfg(Some(3))).unwrap();
    let b = Endpoint::new(cfg(Some(5))).unwrap();
    assert_eq!((a.gpu_index(), b.gpu_index()), (Some(3), Some(5)));
    let addr = a.metadata().control_addr;
    let (ab, ba) = std::thread::scope(|s| {
        let accepted = s.spawn(|| a.accept_timeout(DEADLINE));
        let ba = b.connect_addr(addr).expect("connect_addr");
        (accepted.join().unwrap().expect("accept"), ba)
    });
    assert_eq!(ab.peer_gpu(), Some(5));
    assert_eq!(ba.peer_gpu(), Some(3));
    assert_eq!(ba.peer(), addr);
    let len = 300 * KIB;
    let src = source(&b, len, 7);
    let dst = a.alloc_host(len).unwrap();
    send_verified(&ba, &ab, &src, &dst, len, 7);

    // An endpoint without an index announces none.
    let c = Endpoint::new(cfg(None)).unwrap();
    assert_eq!(c.gpu_index(), None);
    let (ac, ca) = connect(&a, &c);
    assert_eq!((ac.peer_gpu(), ca.peer_gpu()), (None, Some(3)));
}
