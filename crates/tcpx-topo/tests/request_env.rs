//! `PlanRequest::from_vars`: which variables feed which fields.

use std::collections::HashMap;

use tcpx_topo::{NicCandidate, PlanRequest, TopoError};

fn from(vars: &[(&str, &str)]) -> Result<PlanRequest, TopoError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    PlanRequest::from_vars(|k| map.get(k).cloned())
}

#[test]
fn reads_every_variable() {
    let req = from(&[
        ("TCPX_GPU_NIC_MAP", "0,1:eth1"),
        ("NCCL_GPUDIRECTTCPX_TX_BINDINGS", "eth1:8-21"),
        ("NCCL_GPUDIRECTTCPX_RX_BINDINGS", "eth1:22-35"),
        ("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", "eth1, eth2"),
        ("TCPX_NUM_CHANNELS", "6"),
    ])
    .unwrap();
    assert_eq!(req.gpu_nic_map.as_deref(), Some("0,1:eth1"));
    assert_eq!(req.tx_bindings.as_deref(), Some("eth1:8-21"));
    assert_eq!(req.rx_bindings.as_deref(), Some("eth1:22-35"));
    assert_eq!(
        req.nics,
        Some(vec![NicCandidate::new("eth1"), NicCandidate::new("eth2")])
    );
    assert_eq!(req.channels_per_gpu, 6);
    assert_eq!(
        req.gpus, None,
        "GPUs come from the CUDA layer, not the environment"
    );
}

#[test]
fn empty_environment_is_the_default_request() {
    assert_eq!(from(&[]).unwrap(), PlanRequest::default());
    assert_eq!(
        from(&[("TCPX_GPU_NIC_MAP", "  ")]).unwrap(),
        PlanRequest::default()
    );
}

#[test]
fn uccl_alias_counts_and_bad_counts_are_named() {
    assert_eq!(
        from(&[("UCCL_TCPX_NUM_CHANNELS", "3")])
            .unwrap()
            .channels_per_gpu,
        3
    );
    let err = from(&[("UCCL_TCPX_NUM_CHANNELS", "many")]).unwrap_err();
    assert!(err.to_string().contains("UCCL_TCPX_NUM_CHANNELS"), "{err}");
}

#[test]
fn from_env_reads_the_process_environment_without_error() {
    // Whatever the runner's environment holds, from_env is from_vars over it.
    let direct = PlanRequest::from_vars(|k| std::env::var(k).ok());
    match (PlanRequest::from_env(), direct) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        (a, b) => panic!("from_env {a:?} differs from from_vars {b:?}"),
    }
}
