use fusion::prelude::*;

fusion! {
    /// Mistakes in declared types: the caret is on the part of the type at fault.
    fn device_twice<m>(a: Tensor<f32, [m], mesh = [0, 1, 0]>) -> Tensor<f32, [m]> {
        a
    }

    fn mesh_size<m>(a: Tensor<f32, [3 @ DIDx, m], mesh = [0, 1]>) -> Tensor<f32, [3, m]> {
        a
    }

    fn generic_annotation<T: Float, m>(a: Tensor<T, [m]>) -> Tensor<T, [m]> {
        let b: Tensor<bf16, [m]> = relu(a);
        a
    }

    fn tensor_as_extent<m>(a: Tensor<f32, [m]>) -> Tensor<f32, [m]> {
        let b: Tensor<f32, [a]> = a;
        b
    }

    fn extent_of_an_expression<m>(a: Tensor<f32, [m, 2 * m]>) -> Tensor<f32, [m, m]> {
        let b: Tensor<f32, [m, m]> = neg(a);
        b
    }
}

fn main() {}
