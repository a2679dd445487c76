use fusion::prelude::*;

fusion! {
    fn no_return_type<m>(a: Tensor<f32, [m]>) {
        a
    }
}

fusion! {
    fn not_a_tensor<m>(a: Vec<f32>) -> Tensor<f32, [m]> {
        a
    }
}

fusion! {
    fn nothing_returned<m>(a: Tensor<f32, [m]>) -> Tensor<f32, [m]> {
        let b = relu(a);
    }

    fn a_semicolon_too_many<m>(a: Tensor<f32, [m]>) -> Tensor<f32, [m]> {
        relu(a);
    }

    fn not_an_extent<m>(a: Tensor<f32, [m % 2]>) -> Tensor<f32, [m]> {
        a
    }
}

fn main() {}
