//! Generates the splitproxy.v1 Rust code and the file descriptor set that gRPC reflection
//! serves. protoc comes from protoc-bin-vendored, so a fresh machine needs no manual step.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY-free: build scripts are single-threaded; set_var is unsafe in edition 2024.
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        unsafe { std::env::set_var("PROTOC", protoc) };
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("splitproxy_descriptor.bin"))
        .compile_protos(
            &[
                "proto/splitproxy/v1/dataplane.proto",
                "proto/splitproxy/v1/ruleset.proto",
            ],
            &["proto"],
        )?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
