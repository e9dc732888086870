fn main() {
    println!("cargo:rerun-if-changed=proto/runtime/v1/api.proto");
    tonic_prost_build::configure()
        // vesseld keeps CRI configs in its records (JSON), as they came. A field a later API
        // adds is absent from the records an earlier vesseld wrote: it reads as its default
        // (as prost reads it from the wire), so records survive an upgrade.
        .type_attribute(".", "#[derive(serde::Serialize, serde::Deserialize)]")
        .message_attribute(".", "#[serde(default)]")
        .compile_protos(&["proto/runtime/v1/api.proto"], &["proto/"])
        .expect("compiling proto/runtime/v1/api.proto (is protoc installed? see scripts/deps.sh)");
}
