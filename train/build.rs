fn main() {
    libtorch_link::emit();
    libtorch_link::compile_cpp("headway_autocast", &["csrc/autocast.cpp"]);
}
