fn main() {
    libtorch_link::emit();
}
