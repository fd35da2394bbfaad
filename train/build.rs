fn main() {
    libtorch_link::emit();
    libtorch_link::compile_cpp("headway_autocast", &["csrc/autocast.cpp"], &[]);
    // c10d's Gloo process group; see csrc/gloo_declarations/gloo/context.h for why the
    // declarations are Headway's.
    libtorch_link::compile_cpp(
        "headway_distributed",
        &["csrc/distributed.cpp"],
        &["csrc/gloo_declarations"],
    );
}
