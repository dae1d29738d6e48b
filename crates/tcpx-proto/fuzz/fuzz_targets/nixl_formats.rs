//! The NIXL plugin's three formats (connection info, public memory data, notification
//! payloads): the first byte picks one, the rest is the blob.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcpx_proto::nixl::{decode_conn_info, decode_notif, encode_conn_info, encode_notif, PublicMem};

fuzz_target!(|data: &[u8]| {
    let Some((&pick, blob)) = data.split_first() else {
        return;
    };
    match pick % 3 {
        0 => {
            if let Ok(p) = decode_conn_info(blob) {
                let meta = &blob[p.metadata.0..p.metadata.0 + p.metadata.1];
                let local = &blob[p.local.0..p.local.0 + p.local.1];
                assert_eq!(encode_conn_info(meta, local).unwrap(), blob);
            }
        }
        1 => {
            if let Ok(m) = PublicMem::decode(blob) {
                assert_eq!(m.encode(), blob);
            }
        }
        _ => {
            if let Ok(p) = decode_notif(blob) {
                let agent = &blob[p.agent.0..p.agent.0 + p.agent.1];
                assert_eq!(encode_notif(p.kind, agent, &blob[p.msg.0..]).unwrap(), blob);
            }
        }
    }
});
