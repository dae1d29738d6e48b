//! Every size and offset listed in docs/NCCL_NET_ABI.md, checked against the generated bindings.
//! If one of these fails, the header (include/tcpx_net.h) disagrees with the ABI: fix the header,
//! never the test.

use std::mem::{align_of, offset_of, size_of};

use tcpx_sys::*;

const PTR: usize = size_of::<usize>();

#[test]
fn constants_match_the_abi() {
    assert_eq!(HANDLE_SIZE, 128);
    assert_eq!(MAX_REQUESTS, 16);
    assert_eq!((NCCL_PTR_HOST, NCCL_PTR_CUDA, NCCL_PTR_DMABUF), (1, 2, 4));
    assert_eq!(
        (
            NCCL_NET_DEVICE_HOST,
            NCCL_NET_DEVICE_UNPACK,
            NCCL_NET_DEVICE_UNPACK_VERSION
        ),
        (0, 1, 7)
    );
    let codes = [
        NCCL_SUCCESS,
        NCCL_UNHANDLED_CUDA_ERROR,
        NCCL_SYSTEM_ERROR,
        NCCL_INTERNAL_ERROR,
        NCCL_INVALID_ARGUMENT,
        NCCL_INVALID_USAGE,
        NCCL_REMOTE_ERROR,
        NCCL_IN_PROGRESS,
    ];
    assert_eq!(codes, [0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(size_of::<ncclResult_t>(), 4);
}

#[test]
fn function_tables_are_pointer_arrays_in_abi_order() {
    assert_eq!(size_of::<ncclNet_v8_t>(), 19 * PTR);
    assert_eq!(size_of::<ncclNet_v8_t>(), 152);
    assert_eq!(size_of::<ncclNet_v7_t>(), 152);
    assert_eq!(size_of::<ncclNet_v6_t>(), 17 * PTR);
    macro_rules! order {
        ($t:ty, [$($field:ident),*]) => {{
            let mut i = 0usize;
            $( assert_eq!(offset_of!($t, $field), i * PTR, concat!(stringify!($t), "::", stringify!($field))); i += 1; )*
            let _ = i;
        }};
    }
    order!(
        ncclNet_v8_t,
        [
            name,
            init,
            devices,
            getProperties,
            listen,
            connect,
            accept,
            regMr,
            regMrDmaBuf,
            deregMr,
            isend,
            irecv,
            iflush,
            test,
            closeSend,
            closeRecv,
            closeListen,
            getDeviceMr,
            irecvConsumed
        ]
    );
    order!(
        ncclNet_v7_t,
        [
            name,
            init,
            devices,
            getProperties,
            listen,
            connect,
            accept,
            regMr,
            regMrDmaBuf,
            deregMr,
            isend,
            irecv,
            iflush,
            test,
            closeSend,
            closeRecv,
            closeListen,
            getDeviceMr,
            irecvConsumed
        ]
    );
    order!(
        ncclNet_v6_t,
        [
            name,
            init,
            devices,
            getProperties,
            listen,
            connect,
            accept,
            regMr,
            regMrDmaBuf,
            deregMr,
            isend,
            irecv,
            iflush,
            test,
            closeSend,
            closeRecv,
            closeListen
        ]
    );
}

#[test]
fn v7_properties_layout() {
    type P = ncclNetProperties_v7_t;
    assert_eq!(size_of::<P>(), 56);
    assert_eq!(offset_of!(P, name), 0);
    assert_eq!(offset_of!(P, pciPath), 8);
    assert_eq!(offset_of!(P, guid), 16);
    assert_eq!(offset_of!(P, ptrSupport), 24);
    assert_eq!(offset_of!(P, speed), 28);
    assert_eq!(offset_of!(P, port), 32);
    assert_eq!(offset_of!(P, latency), 36);
    assert_eq!(offset_of!(P, maxComms), 40);
    assert_eq!(offset_of!(P, maxRecvs), 44);
    assert_eq!(offset_of!(P, netDeviceType), 48);
    assert_eq!(offset_of!(P, netDeviceVersion), 52);
}

#[test]
fn v8_properties_insert_reg_is_global_at_28() {
    type P = ncclNetProperties_v8_t;
    assert_eq!(size_of::<P>(), 64);
    assert_eq!(offset_of!(P, ptrSupport), 24);
    assert_eq!(offset_of!(P, regIsGlobal), 28);
    assert_eq!(offset_of!(P, speed), 32);
    assert_eq!(offset_of!(P, port), 36);
    assert_eq!(offset_of!(P, latency), 40);
    assert_eq!(offset_of!(P, maxComms), 44);
    assert_eq!(offset_of!(P, maxRecvs), 48);
    assert_eq!(offset_of!(P, netDeviceType), 52);
    assert_eq!(offset_of!(P, netDeviceVersion), 56);
}

#[test]
fn v6_properties_stop_after_max_recvs() {
    type P = ncclNetProperties_v6_t;
    assert_eq!(size_of::<P>(), 48);
    assert_eq!(offset_of!(P, maxRecvs), 44);
}

#[test]
fn device_handle_layout() {
    type H = ncclNetDeviceHandle_v7_t;
    assert_eq!(size_of::<H>(), 32);
    assert_eq!(offset_of!(H, netDeviceType), 0);
    assert_eq!(offset_of!(H, netDeviceVersion), 4);
    assert_eq!(offset_of!(H, handle), 8);
    assert_eq!(offset_of!(H, size), 16);
    assert_eq!(offset_of!(H, needsProxyProgress), 24);
    assert_eq!(size_of::<ncclNetDeviceHandle_v8_t>(), 32);
}

#[test]
fn unpack_metadata_layout() {
    assert_eq!(size_of::<tcpxLoadMeta>(), 16);
    assert_eq!(align_of::<tcpxLoadMeta>(), 16);
    assert_eq!(offset_of!(tcpxLoadMeta, src_off), 0);
    assert_eq!(offset_of!(tcpxLoadMeta, len), 4);
    assert_eq!(offset_of!(tcpxLoadMeta, dst_off), 8);

    assert_eq!(size_of::<tcpxUnpackMeta>(), UNPACK_META_SIZE);
    assert_eq!(size_of::<tcpxUnpackMeta>(), 524_416);
    assert_eq!(offset_of!(tcpxUnpackMeta, cnt), UNPACK_CNT_OFFSET);
    assert_eq!(offset_of!(tcpxUnpackMeta, cnt), 524_288);

    type U = tcpxUnpackDeviceHandle;
    assert_eq!(size_of::<U>(), 24);
    assert_eq!(offset_of!(U, meta), 0);
    assert_eq!(offset_of!(U, bounce_buf), 8);
    assert_eq!(offset_of!(U, head), 16);
}
