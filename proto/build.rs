//! Generates the splitproxy.v1 Rust code and the file descriptor set that gRPC reflection
//! serves. protoc comes from protoc-bin-vendored, so a fresh machine needs no manual step.
//!
//! A second pass generates the brain's server for the same service with `Update` replaced by
//! `crate::frames::UpdateFrame`: the same bytes on the wire, but the body is pre-encoded once
//! and shared by every stream that needs it (see `frames.rs`).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: build scripts are single-threaded; set_var is unsafe in edition 2024 only
        // because of other threads.
        unsafe { std::env::set_var("PROTOC", protoc) };
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let protos = [
        "proto/splitproxy/v1/dataplane.proto",
        "proto/splitproxy/v1/ruleset.proto",
    ];
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("splitproxy_descriptor.bin"))
        .compile_protos(&protos, &["proto"])?;

    let frames = out.join("frames");
    std::fs::create_dir_all(&frames)?;
    tonic_prost_build::configure()
        .build_client(false)
        .out_dir(&frames)
        .extern_path(".splitproxy.v1", "crate::v1")
        .extern_path(".splitproxy.v1.Update", "crate::frames::UpdateFrame")
        .compile_protos(&protos[..1], &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
