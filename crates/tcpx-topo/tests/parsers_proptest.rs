//! Property tests for the text parsers: arbitrary input never panics, and well-formed
//! input round-trips.

use proptest::prelude::*;
use tcpx_topo::{Bindings, GpuNicMap, PciBusId, PlanRequest, GPU_NIC_MAP_VAR};

proptest! {
    #[test]
    fn override_parser_never_panics(input in ".{0,80}") {
        if let Err(e) = GpuNicMap::parse(GPU_NIC_MAP_VAR, &input) {
            prop_assert!(e.to_string().contains(GPU_NIC_MAP_VAR), "{}", e);
        }
    }

    #[test]
    fn override_parser_never_panics_on_near_miss_input(input in "[0-9,;:eth \\-]{0,40}") {
        if let Ok(map) = GpuNicMap::parse(GPU_NIC_MAP_VAR, &input) {
            prop_assert!(!map.by_gpu.is_empty());
            prop_assert!(map.by_gpu.values().all(|nics| !nics.is_empty()));
        }
    }

    #[test]
    fn well_formed_override_round_trips(
        entries in proptest::collection::btree_map(0usize..64, "eth[0-9]{1,2}", 1..8)
    ) {
        let text: Vec<String> = entries.iter().map(|(g, n)| format!("{g}:{n}")).collect();
        let map = GpuNicMap::parse(GPU_NIC_MAP_VAR, &text.join(";")).unwrap();
        prop_assert_eq!(map.by_gpu.len(), entries.len());
        for (g, n) in &entries {
            prop_assert_eq!(map.nics_for(*g), Some(std::slice::from_ref(n)));
        }
    }

    #[test]
    fn bindings_parser_never_panics(input in ".{0,80}") {
        if let Err(e) = Bindings::parse("NCCL_GPUDIRECTTCPX_TX_BINDINGS", &input) {
            prop_assert!(e.to_string().contains("NCCL_GPUDIRECTTCPX_TX_BINDINGS"), "{}", e);
        }
    }

    #[test]
    fn pci_bus_id_parser_never_panics(input in ".{0,24}") {
        if let Ok(id) = input.parse::<PciBusId>() {
            // Whatever parses prints back in canonical form and parses to the same id.
            prop_assert_eq!(id.to_string().parse::<PciBusId>().unwrap(), id);
        }
    }

    #[test]
    fn pci_bus_id_round_trips(domain in 0u32..0x10000, bus: u8, device in 0u8..32, function in 0u8..8) {
        let id = PciBusId::new(domain, bus, device, function).unwrap();
        prop_assert_eq!(id.to_string().parse::<PciBusId>().unwrap(), id);
    }

    #[test]
    fn plan_request_from_vars_never_panics(value in ".{0,40}") {
        // Every variable holds the same text: only the channel count is parsed here.
        let numeric = value.trim().parse::<usize>().is_ok() || value.trim().is_empty();
        prop_assert_eq!(PlanRequest::from_vars(|_| Some(value.clone())).is_ok(), numeric);
    }
}
