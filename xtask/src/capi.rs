//! `cargo xtask capi [--check] [--test] [--install PREFIX]`: the C API.
//!
//! - Generates `crates/tcpx-capi/include/tcpx.h` with cbindgen (checked in); `--check` fails
//!   when the checked-in header differs from what the source generates.
//! - Builds `libtcpx.so` / `libtcpx.a` (release) and copies them to `target/capi/lib/`, writes
//!   `target/capi/tcpx.pc`, and compiles the C examples, the C test program and a C++17
//!   translation unit (`-Wall -Werror`) with the system compilers (`cc`, `c++`) into
//!   `target/capi/`.
//! - `--test` runs the C test program (two processes over 127.0.0.1), then again under
//!   valgrind (definite leaks and memory errors fail), then the two examples as process pairs.
//!   It starts an etcd on 127.0.0.1 for the test program's rendezvous scenario
//!   (`TCPX_TEST_ETCD`, a store URL) and stops it after; without an etcd binary that scenario
//!   skips.
//! - `--install PREFIX` copies the libraries, header and a `tcpx.pc` pointing at PREFIX into
//!   PREFIX/lib, PREFIX/include and PREFIX/lib/pkgconfig.
//!
//! `--check` alone only checks the header (fast, no build).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::{run_command, workspace_root};

const USAGE: &str = "usage: cargo xtask capi [--check] [--test] [--install PREFIX]";

/// The C test program's limit; under valgrind everything runs tens of times slower.
const TEST_LIMIT: Duration = Duration::from_secs(300);
const VALGRIND_LIMIT: Duration = Duration::from_secs(900);
const EXAMPLE_LIMIT: Duration = Duration::from_secs(120);

struct Options {
    check: bool,
    test: bool,
    install: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        check: false,
        test: false,
        install: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--check" => o.check = true,
            "--test" => o.test = true,
            "--install" => {
                let dir = it.next().context("--install needs a directory")?;
                o.install = Some(PathBuf::from(dir));
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument `{other}`\n{USAGE}"),
        }
    }
    Ok(o)
}

pub fn run(args: &[String]) -> Result<()> {
    let o = parse(args)?;
    let root = workspace_root();
    let krate = root.join("crates/tcpx-capi");
    let header = krate.join("include/tcpx.h");
    let generated = generate(&krate)?;
    if o.check {
        let current = std::fs::read_to_string(&header).unwrap_or_default();
        if current != generated {
            bail!(
                "{} is out of date with crates/tcpx-capi/src: run `cargo xtask capi` and commit \
                 the result",
                header.display()
            );
        }
        println!("C header up to date: {}", header.display());
        if !o.test && o.install.is_none() {
            return Ok(());
        }
    } else if std::fs::read_to_string(&header).ok().as_deref() != Some(generated.as_str()) {
        std::fs::write(&header, &generated)
            .with_context(|| format!("cannot write {}", header.display()))?;
        println!("wrote {}", header.display());
    }

    let built = build(&root)?;
    let out = root.join("target/capi");
    std::fs::create_dir_all(&out)?;
    // The C programs link against copies in target/capi/lib, not against target/release:
    // a later cargo build there (a rebuild with other flags, another profile) must not swap
    // the library under a test that is running.
    let built = stage(&built, &out.join("lib"))?;
    let pc = pkg_config(&built.libdir, &krate.join("include"), &built.native_libs);
    std::fs::write(out.join("tcpx.pc"), pc)?;
    compile(&root, &built, &out)?;
    println!(
        "built {}/libtcpx.{{so,a}}, {}/tcpx.pc and the C programs in {}",
        built.libdir.display(),
        out.display(),
        out.display()
    );
    if let Some(prefix) = &o.install {
        install(prefix, &built, &header)?;
    }
    if o.test {
        test(&out)?;
    }
    Ok(())
}

/// Runs cbindgen over the capi crate with its `cbindgen.toml`.
fn generate(krate: &Path) -> Result<String> {
    let config = cbindgen::Config::from_file(krate.join("cbindgen.toml"))
        .map_err(|e| anyhow::anyhow!("reading cbindgen.toml: {e}"))?;
    let bindings = cbindgen::Builder::new()
        .with_crate(krate)
        .with_config(config)
        .generate()
        .map_err(|e| anyhow::anyhow!("cbindgen failed on {}: {e}", krate.display()))?;
    let mut text = Vec::new();
    bindings.write(&mut text);
    String::from_utf8(text).context("cbindgen wrote non-UTF-8")
}

struct Built {
    libdir: PathBuf,
    /// What a static link of `libtcpx.a` needs after it (rustc's `native-static-libs`).
    native_libs: String,
}

/// Builds the libraries in release and learns the static link line.
fn build(root: &Path) -> Result<Built> {
    let libdir = root.join("target/release");
    let cache = root.join("target/capi/native-static-libs.txt");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let run = |force: bool| -> Result<Option<String>> {
        if force {
            // rustc prints the list only when it links: make it link once.
            let lib = root.join("crates/tcpx-capi/src/lib.rs");
            let text = std::fs::read(&lib)?;
            std::fs::write(&lib, text)?;
        }
        let output = Command::new(&cargo)
            .current_dir(root)
            .args(["rustc", "--release", "-p", "tcpx-capi", "--lib"])
            .args(["--", "--print", "native-static-libs"])
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped())
            .output()
            .context("cannot run cargo")?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() {
            eprint!("{stderr}");
            bail!("building tcpx-capi failed");
        }
        Ok(stderr
            .lines()
            .find_map(|l| l.split("native-static-libs:").nth(1))
            .map(|s| s.trim().to_string()))
    };
    let native_libs = match run(false)? {
        Some(libs) => libs,
        None => match std::fs::read_to_string(&cache) {
            Ok(libs) if !libs.trim().is_empty() => libs.trim().to_string(),
            _ => run(true)?.context("rustc printed no native-static-libs line")?,
        },
    };
    std::fs::create_dir_all(cache.parent().expect("target/capi"))?;
    std::fs::write(&cache, &native_libs)?;
    Ok(Built {
        libdir,
        native_libs,
    })
}

/// Copies both libraries into `dir` (each through a temporary name and a rename, so a program
/// still running keeps the file it loaded).
fn stage(built: &Built, dir: &Path) -> Result<Built> {
    std::fs::create_dir_all(dir)?;
    for f in ["libtcpx.so", "libtcpx.a"] {
        let tmp = dir.join(format!(".{f}.tmp"));
        std::fs::copy(built.libdir.join(f), &tmp)
            .with_context(|| format!("cannot copy {f} into {}", dir.display()))?;
        std::fs::rename(&tmp, dir.join(f))?;
    }
    Ok(Built {
        libdir: dir.to_path_buf(),
        native_libs: built.native_libs.clone(),
    })
}

fn pkg_config(libdir: &Path, includedir: &Path, native_libs: &str) -> String {
    format!(
        "libdir={}\nincludedir={}\n# What a static link of libtcpx.a needs after it:\n\
         # cc app.o ${{libdir}}/libtcpx.a $(pkg-config --variable=static_libs tcpx)\n\
         static_libs={}\n\nName: tcpx\nDescription: GPU and host transfers over an ncclNet \
         plugin (GPUDirect-TCPX or kernel TCP): the tcpx C API\nVersion: {}\n\
         Libs: -L${{libdir}} -ltcpx\nLibs.private: ${{static_libs}}\nCflags: -I${{includedir}}\n",
        libdir.display(),
        includedir.display(),
        native_libs,
        env!("CARGO_PKG_VERSION"),
    )
}

/// Compiles the examples, the test program and the C++ translation unit.
fn compile(root: &Path, built: &Built, out: &Path) -> Result<()> {
    let krate = root.join("crates/tcpx-capi");
    let include = krate.join("include");
    let rpath = format!("-Wl,-rpath,{}", built.libdir.display());
    let cc = |src: &str, exe: &str| -> Result<()> {
        run_command(
            Command::new("cc")
                .args(["-std=c11", "-D_GNU_SOURCE", "-O2", "-g"])
                .args(["-Wall", "-Wextra", "-Werror"])
                .arg("-I")
                .arg(&include)
                .arg(krate.join(src))
                .arg("-o")
                .arg(out.join(exe))
                .arg("-L")
                .arg(&built.libdir)
                .args(["-ltcpx", &rpath]),
        )
    };
    cc("examples/send_recv.c", "send_recv")?;
    cc("examples/onesided_write.c", "onesided_write")?;
    cc("tests/c/capi_test.c", "capi_test")?;
    // The C++ host's view: tcpx.h under -Wall -Werror in C++17, linked against the static
    // library (which must carry everything but the system libraries it lists).
    let mut cxx = Command::new("c++");
    cxx.args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg("-I")
        .arg(&include)
        .arg(krate.join("tests/c/header_cxx.cpp"))
        .arg("-o")
        .arg(out.join("header_cxx"))
        .arg(built.libdir.join("libtcpx.a"))
        .args(built.native_libs.split_whitespace());
    run_command(&mut cxx)
}

fn install(prefix: &Path, built: &Built, header: &Path) -> Result<()> {
    let lib = prefix.join("lib");
    let inc = prefix.join("include");
    let pcdir = lib.join("pkgconfig");
    for d in [&lib, &inc, &pcdir] {
        std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
    }
    for f in ["libtcpx.so", "libtcpx.a"] {
        std::fs::copy(built.libdir.join(f), lib.join(f))
            .with_context(|| format!("cannot install {f}"))?;
    }
    std::fs::copy(header, inc.join("tcpx.h"))?;
    std::fs::write(
        pcdir.join("tcpx.pc"),
        pkg_config(&lib, &inc, &built.native_libs),
    )?;
    println!(
        "installed into {} (PKG_CONFIG_PATH={})",
        prefix.display(),
        pcdir.display()
    );
    Ok(())
}

/// Loopback only: the plugin, NCCL and every control listener stay on `lo` / 127.0.0.1. And
/// no `LD_LIBRARY_PATH`: `cargo run` points it at target/debug, whose `libtcpx.so` (from a
/// `cargo build`) would win over the programs' rpath and test a stale library.
fn loopback(cmd: &mut Command) -> &mut Command {
    cmd.env_remove("LD_LIBRARY_PATH")
        .env("TCPX_SOCKET_IFNAME", "lo")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("TCPX_CONTROL_ADDR", "127.0.0.1:0")
        .env("TCPX_BACKEND", "builtin")
}

fn test(out: &Path) -> Result<()> {
    crate::sysdeps::ensure(&["valgrind"])?;

    // The rendezvous scenario's store: an etcd on 127.0.0.1 for the whole test (the C
    // program starts nothing itself), or none, and the scenario says it skipped.
    let etcd = match crate::etcd::binary() {
        Some(_) => Some(crate::etcd::LocalEtcd::start()?),
        None => {
            println!(
                "(no etcd binary: the C rendezvous scenario skips; apt-get install etcd-server)"
            );
            None
        }
    };
    let with_etcd = |cmd: &mut Command| {
        if let Some(etcd) = &etcd {
            cmd.env("TCPX_TEST_ETCD", etcd.url("capi"));
        }
    };

    println!("\n---- C test program (two processes over 127.0.0.1)");
    let t = Instant::now();
    let mut plain = Command::new(out.join("capi_test"));
    with_etcd(&mut plain);
    run_limited(loopback(&mut plain), TEST_LIMIT)?;
    println!("---- passed in {:.1}s", t.elapsed().as_secs_f64());

    println!("\n---- C++17 translation unit, static library");
    run_limited(
        loopback(&mut Command::new(out.join("header_cxx"))),
        EXAMPLE_LIMIT,
    )?;

    println!("\n---- C test program under valgrind (memcheck, definite leaks fail)");
    let t = Instant::now();
    let mut vg = Command::new("valgrind");
    vg.args([
        "--error-exitcode=1",
        "--leak-check=full",
        "--errors-for-leak-kinds=definite",
        "--show-leak-kinds=definite",
        "--child-silent-after-fork=no",
        "--quiet",
    ])
    // One suppression, for a leak inside hwloc's PCI component on some hosts (see the file);
    // the test program, the runtime and the socket plugin run clean without any.
    .arg(format!(
        "--suppressions={}",
        workspace_root()
            .join("crates/tcpx-capi/tests/c/valgrind.supp")
            .display()
    ))
    .arg(out.join("capi_test"))
    .arg("--valgrind");
    with_etcd(&mut vg);
    run_limited(loopback(&mut vg), VALGRIND_LIMIT)?;
    println!("---- passed in {:.1}s", t.elapsed().as_secs_f64());

    println!("\n---- examples (server and client processes)");
    let dir = out.join("run");
    std::fs::create_dir_all(&dir)?;
    let meta = dir.join("send_recv.meta");
    let _ = std::fs::remove_file(&meta);
    pair(
        loopback(Command::new(out.join("send_recv")).arg("server").arg(&meta)),
        loopback(Command::new(out.join("send_recv")).arg("client").arg(&meta)),
        &meta,
    )?;
    let addr = dir.join("onesided.addr");
    let _ = std::fs::remove_file(&addr);
    pair(
        loopback(
            Command::new(out.join("onesided_write"))
                .arg("target")
                .arg(&addr),
        ),
        loopback(
            Command::new(out.join("onesided_write"))
                .arg("initiator")
                .arg(&addr),
        ),
        &addr,
    )?;
    println!("---- C API: all passed");
    Ok(())
}

/// Starts `server`, waits for it to write `rendezvous`, runs `client`; both must succeed.
fn pair(server: &mut Command, client: &mut Command, rendezvous: &Path) -> Result<()> {
    let mut s = server
        .spawn()
        .with_context(|| format!("cannot start {server:?}"))?;
    let deadline = Instant::now() + EXAMPLE_LIMIT;
    while !rendezvous.exists() {
        if let Some(status) = s.try_wait()? {
            bail!(
                "{server:?} exited before writing {}: {status}",
                rendezvous.display()
            );
        }
        if Instant::now() >= deadline {
            let _ = s.kill();
            bail!("{server:?} wrote no {} in time", rendezvous.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let client_result = run_limited(client, EXAMPLE_LIMIT);
    let server_result = wait_limited(&mut s, &format!("{server:?}"), EXAMPLE_LIMIT);
    client_result.and(server_result)
}

/// Runs `cmd` to completion, killing it once `limit` has passed (also used by `nixl`).
pub(crate) fn run_limited(cmd: &mut Command, limit: Duration) -> Result<()> {
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {cmd:?}"))?;
    wait_limited(&mut child, &format!("{cmd:?}"), limit)
}

fn wait_limited(child: &mut Child, what: &str, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            if !status.success() {
                bail!("{what} failed: {status}");
            }
            return Ok(());
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{what} did not finish within {limit:?}; killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
