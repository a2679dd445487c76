use fusion::prelude::*;

fusion! {
    /// A dtype parameter's bound is `Float`.
    pub fn bound<T: Copy, n>(x: Tensor<T, [n]>) -> Tensor<T, [n]> {
        neg(x)
    }
}

fusion! {
    /// An undeclared dtype parameter.
    pub fn undeclared<n>(x: Tensor<T, [n]>) -> Tensor<f32, [n]> {
        cast(x, f32)
    }
}

fn main() {}
