//! Builds the C logger shim: NCCL's logger is a variadic printf-style function, which stable Rust
//! cannot define; the shim formats the message with vsnprintf and hands a plain string to Rust.

fn main() {
    println!("cargo:rerun-if-changed=src/logger_shim.c");
    cc::Build::new()
        .file("src/logger_shim.c")
        .warnings(true)
        .extra_warnings(true)
        .compile("tcpx_logger_shim");
}
