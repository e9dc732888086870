fn main() {
    println!("cargo:rerun-if-changed=proto/agent.proto");
    tonic_prost_build::configure()
        .compile_protos(&["proto/agent.proto"], &["proto/"])
        .expect("compiling proto/agent.proto (is protoc installed? see scripts/deps.sh)");
}
