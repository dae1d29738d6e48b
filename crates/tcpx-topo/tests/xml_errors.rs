//! Bad topology input gives an error naming the input, never a panic or a crash in hwloc.

mod common;

use tcpx_topo::{TopoError, Topology};

#[test]
fn missing_file_names_the_path() {
    let path = common::fixture("does-not-exist.xml");
    let err = Topology::from_xml_file(&path).unwrap_err();
    assert!(matches!(err, TopoError::ReadXml { .. }), "{err}");
    assert!(err.to_string().contains("does-not-exist.xml"), "{err}");
}

#[test]
fn empty_file_and_empty_string_are_empty_xml() {
    let dir = std::env::temp_dir().join(format!("tcpx-topo-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("empty.xml");
    std::fs::write(&path, "").unwrap();
    let err = Topology::from_xml_file(&path).unwrap_err();
    assert!(matches!(err, TopoError::EmptyXml { .. }), "{err}");
    assert!(err.to_string().contains("empty.xml"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();

    let err = Topology::from_xml_str(" \n\t").unwrap_err();
    assert!(matches!(err, TopoError::EmptyXml { .. }), "{err}");
}

#[test]
fn malformed_xml_is_invalid_xml() {
    for bad in [
        "<topology>",
        "not xml at all",
        "<?xml version=\"1.0\"?><nottopology/>",
        "<topology version=\"2.0\"><object type=\"Machine\"",
    ] {
        let err = Topology::from_xml_str(bad).unwrap_err();
        assert!(
            matches!(err, TopoError::InvalidXml { .. }),
            "{bad:?}: {err}"
        );
        assert!(err.to_string().contains("<string>"), "{err}");
    }
}

#[test]
fn truncated_fixture_is_invalid_xml() {
    let full = std::fs::read_to_string(common::fixture("two-gpu-one-nic.xml")).unwrap();
    let err = Topology::from_xml_str(&full[..full.len() / 2]).unwrap_err();
    assert!(matches!(err, TopoError::InvalidXml { .. }), "{err}");
}

#[test]
fn xml_without_complete_sets_is_refused_before_hwloc_crashes_on_it() {
    let full = std::fs::read_to_string(common::fixture("two-gpu-one-nic.xml")).unwrap();
    for attr in ["complete_cpuset", "complete_nodeset"] {
        let stripped = strip_attr(&full, attr);
        let err = Topology::from_xml_str(&stripped).unwrap_err();
        assert!(matches!(err, TopoError::InvalidXml { .. }), "{err}");
        assert!(err.to_string().contains(attr), "{err}");
    }
}

#[test]
fn nul_byte_is_invalid_xml() {
    let err = Topology::from_xml_str("<topology>\0</topology>").unwrap_err();
    assert!(matches!(err, TopoError::InvalidXml { .. }), "{err}");
}

/// Removes every `attr="…"` from `xml`.
fn strip_attr(xml: &str, attr: &str) -> String {
    let needle = format!(" {attr}=\"");
    let mut out = String::with_capacity(xml.len());
    let mut rest = xml;
    while let Some(at) = rest.find(&needle) {
        out.push_str(&rest[..at]);
        let after = &rest[at + needle.len()..];
        let end = after.find('"').map_or(after.len(), |e| e + 1);
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}
