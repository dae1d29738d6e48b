//! Discovery of the machine the tests run on. It may have no GPU (CI has none); it must
//! load, and planning must work, without panicking.

use tcpx_topo::{Plan, PlanRequest, Topology};

#[test]
fn live_machine_loads_and_plans() {
    let topo = Topology::from_live().expect("hwloc discovers this machine");
    assert_eq!(topo.origin(), "live");
    assert!(!topo.pus().is_empty(), "a live machine has at least one PU");
    assert!(
        !topo.numa_nodes().is_empty(),
        "hwloc always reports a NUMA node"
    );
    for nic in topo.nics() {
        assert_ne!(nic.name, "lo", "loopback is never a candidate");
        assert_eq!(
            topo.nic_local_cores(&nic.name),
            Some(nic.local_cpus.as_slice())
        );
    }
    let plan = Plan::build(&topo, &PlanRequest::default());
    match (topo.gpus().is_empty(), topo.nics().is_empty(), plan) {
        (true, _, Ok(plan)) => assert!(plan.entries.is_empty()),
        (false, false, Ok(plan)) => assert_eq!(plan.entries.len(), topo.gpus().len()),
        (false, true, Err(e)) => assert!(e.to_string().contains("no NIC"), "{e}"),
        (_, _, other) => panic!("unexpected plan result on this machine: {other:?}"),
    }
}
