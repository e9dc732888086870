fn main() {
    println!("cargo:rerun-if-changed=proto/runtime/v1/api.proto");
    tonic_prost_build::configure()
        // vesseld keeps CRI configs in its records (JSON), as they came.
        .type_attribute(".", "#[derive(serde::Serialize, serde::Deserialize)]")
        .compile_protos(&["proto/runtime/v1/api.proto"], &["proto/"])
        .expect("compiling proto/runtime/v1/api.proto (is protoc installed? see scripts/deps.sh)");
}
