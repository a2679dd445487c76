use fusion::prelude::*;

fusion! {
    fn nothing<m>(a: Tensor<f32, [m]>) -> () {
        a
    }

    fn twice<m, m>(a: Tensor<f32, [m]>, a: Tensor<f32, [m]>) -> Tensor<f32, [m]> {
        a
    }

    fn twice_generic<T: Float, T: Float, n>(x: Tensor<T, [n]>) -> Tensor<T, [n]> {
        x
    }

    fn unbound_split<m, s>(x: Tensor<f32, [m]>) -> Tensor<f32, [s, m / s]> {
        split(x, 0, s)
    }

    fn extent_zero<m>(x: Tensor<f32, [m, 0]>) -> Tensor<f32, [m, 0]> {
        x
    }
}

fn main() {}
